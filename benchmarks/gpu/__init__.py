"""On a GPU: quality at 20 tokens per parameter, the learner's overhead in a GPU training loop, mixed hardware, and
the harness that runs M learners and the syncer's rounds on one device (docs/results.md, "At a size that means
something: on a GPU"). `scale` and `quality` are the entry points; `setup`, `runs`, `overhead`, `report`,
`device_rounds` and `corpus` are their parts."""
