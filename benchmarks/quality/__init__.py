"""How good: decoupled training's final loss and tokens against data-parallel's, per setting (docs/results.md,
"How good")."""
