"""Config selection: the heuristic (`heuristic`), autotune results (`table`) and timings (`tuner`), and the one
policy that decides which config a call launches (`policy.choose_launch`)."""

from .heuristic import Choice, choose, grouped_choice, m_bucket, ranked
from .policy import Launch, Source, choose_launch, config_for, launches_for_shapes
from .shapes import load_shapes, problem_shape
from .table import (
    Device,
    TuningTable,
    add_tuning,
    bucket,
    entry_key,
    generation,
    grouped_bucket,
    problem_bucket,
    tuned_config,
    tuned_configs,
)
from .tuner import DEFAULT_CANDIDATES, Timer, autotune, candidates, cuda_event_timer, device_ms

__all__ = ["DEFAULT_CANDIDATES", "Choice", "Device", "Launch", "Source", "Timer", "TuningTable", "add_tuning",
           "autotune", "bucket", "candidates", "choose", "choose_launch", "config_for", "cuda_event_timer",
           "device_ms", "entry_key", "generation", "grouped_bucket", "grouped_choice", "launches_for_shapes",
           "load_shapes", "m_bucket", "problem_bucket", "problem_shape", "ranked", "tuned_config", "tuned_configs"]
