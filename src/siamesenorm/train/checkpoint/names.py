"""The names of a checkpoint's files and folders, and the numbers of its two formats. A leaf that
imports nothing: the run folder (:mod:`siamesenorm.rundir`) reads these names too."""

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
CHECKSUM_FILE = "checksums.json"
KEPT_PREFIX = "step_"   # an older checkpoint kept beside the last: step_<N>
OLD_MARK = ".old-"      # a checkpoint being swapped out: .<name>.old-<id>
FORMAT = 1              # model.safetensors + state.pt with the optimizer
SHARDED_FORMAT = 2      # dcp/ (model and optimizer) + state.pt without it
