"""Layout-independent, atomic checkpoints with an integrity manifest (docs/design.md §8)."""

from hybrid.checkpoint.format import FORMAT_VERSION, CheckpointError, Piece
from hybrid.checkpoint.loader import CheckpointReader, resolve_checkpoint_dir
from hybrid.checkpoint.writer import prune_checkpoints, read_latest, save_checkpoint

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointReader", "Piece", "prune_checkpoints",
           "read_latest", "resolve_checkpoint_dir", "save_checkpoint"]
