"""The names of a checkpoint's files and the numbers of its two formats."""

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
CHECKSUM_FILE = "checksums.json"
FORMAT = 1              # model.safetensors + state.pt with the optimizer
SHARDED_FORMAT = 2      # dcp/ (model and optimizer) + state.pt without it
