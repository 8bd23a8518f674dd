"""What the syncer tells an operator: Prometheus metrics, its memory by part, the event tape, posted annotations, the dashboard's history and errors logged once per interval."""
