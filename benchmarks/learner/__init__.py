"""What a learner costs a training loop: step time, memory, allocations, joining (docs/results.md, "At what
cost")."""
