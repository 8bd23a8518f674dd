"""A transport for tests that keeps a Learner's push jobs without reading them, so only the training thread's work
is observed."""

import torch

from diloco.learner.transport import JoinInfo


class Recording:
    def __init__(self, cfg):
        self.cfg, self.jobs, self.stop_requested, self.budget_progress = cfg, [], False, None
        self.closed = False

    def join(self, learner_id, specs, initial):
        return JoinInfo(self.cfg, "s", [(i, 0, v.clone()) for i, v in enumerate(initial(self.cfg.fragments))])

    def push(self, job):
        self.jobs.append(job)

    def arrivals(self, timeout=None):
        return []

    def report(self, **progress):
        pass

    def take_phase_lead(self):
        return None

    def close(self, timeout=None):
        self.closed = True


class ExactRecording(Recording):
    """Also records Δ computed exactly from the model at each push (set `learner` after joining)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.exact, self.learner = [], None

    def push(self, job):
        tensors = self.learner._tensors(self.learner.layout[job.fragment])
        self.exact.append(job.base - torch.cat([t.detach().reshape(-1).float() for t in tensors]))
        super().push(job)
