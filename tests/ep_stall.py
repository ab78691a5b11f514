"""Run by tests/test_expert_parallel.py under torchrun (2 processes, gloo): rank 1 joins the group and then never
answers; rank 0 starts a round of MoE layer 7. With WASTE_EP_TIMEOUT small, rank 0 must stop with one line naming
itself, the layer and the step (runtime/parallel.py's Watch) instead of waiting for ever."""
import os
import sys
import time

import torch

from waste.runtime.parallel import ExpertParallel, ParallelExperts

ep = ExpertParallel.start(os.environ, 2,
                          report=lambda m: print(f"waste: error: {m}", file=sys.stderr, flush=True))
if ep.rank == 1:
    time.sleep(120)             # stuck: never joins the exchange (torchrun ends it once rank 0 has stopped)
else:
    ep.owner = {7: [0, 1]}
    px = ParallelExperts(type("Local", (), {"device": torch.device("cpu")})(), ep)
    px._sizes(torch.tensor([[7, 8], [7, 8]]), "the sizes before MoE layer 7")
    print("not reached")
