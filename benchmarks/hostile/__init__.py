"""Hostile learners: one learner in four attacking for a whole run, against the syncer's defences (docs/results.md,
"Hostile learners")."""
