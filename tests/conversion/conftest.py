"""Settings for the converter tests."""

import torch

# The test models are tiny; with several test runs sharing two cores, intra-op threads only spin and
# wait for each other (measured: generate() 50x slower with 2 threads under load than with 1).
torch.set_num_threads(1)
