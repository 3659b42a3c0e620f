import torch

# Two cores on CI: one intra-op thread per test process keeps timings predictable.
torch.set_num_threads(2)
