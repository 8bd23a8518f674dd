"""How fast: time to a target loss over shaped links, with stragglers and kills, and the bytes each mode sends
(docs/results.md, "How fast")."""
