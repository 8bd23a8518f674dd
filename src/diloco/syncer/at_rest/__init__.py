"""The syncer's state on disk and what it trusts there: the signed manifest and its files, the state key, the folder lock, the global model file, an initial model and the dashboard's history."""
