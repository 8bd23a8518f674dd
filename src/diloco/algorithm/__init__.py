"""The algorithm itself, free of processes, threads and the network: how a model is cut into fragments
(`fragments`), when each is pushed (`schedule`), how outer gradients are encoded (`codec`), merged (`merge`) and
applied (`outer`), when a round closes (`policy`), and the digests that spare a learner values it already holds
(`digest`). The syncer, the learner and the simulator all build on these; none of them imports back."""
