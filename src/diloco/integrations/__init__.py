"""Learners driven from the training frameworks users already have: a Hugging Face `Trainer` callback
(`diloco.integrations.transformers`), a Lightning callback (`diloco.integrations.lightning`), and the pieces
they share. Importing this package imports neither framework; each module imports its own."""
