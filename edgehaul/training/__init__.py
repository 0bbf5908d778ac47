"""Central training: streamed Delta data, PyTorch (single process or torchrun/DDP), committed
checkpoints with resume, quota and placement checks, and the model registry the edge scores with."""
