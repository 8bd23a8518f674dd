"""What one syncer needs: memory by component and by number of learners, merge speed, heartbeat latency, and many
synthetic learners shaped like a real run (docs/results.md, "At what cost")."""
