"""`gemmgen advise`: a training step's GEMMs for a model, a parallel plan and a GPU, on the CPU:
the kernel gemmgen launches for each and why, its tiles and waves, a roofline time (a model,
calibrated on published anchors), the rules the shapes break, the nearest cliffs and the plans
ranked (docs/advise.md).

    spec = gemmgen.advise.load_config("examples/models/llama3_8b.json")
    advice = gemmgen.advise.advise(spec, tokens=8192, gpu=gemmgen.advise.gpu("h100"))
    print(gemmgen.advise.table(advice))
"""

from .advice import Advice, Cliff, Finding, RankedPlan, advise, rules
from .analysis import GemmAnalysis, analyze, roof_tflops
from .gpus import GPUS, Anchor, Gpu, gpu
from .model import ModelSpec, ParallelPlan, RankLayer, load_config, rank_layers
from .precisions import PRECISIONS, precision
from .report import ADVISE_FORMAT, plot, table, to_json

__all__ = ["ADVISE_FORMAT", "GPUS", "PRECISIONS", "Advice", "Anchor", "Cliff", "Finding", "GemmAnalysis", "Gpu",
           "ModelSpec", "ParallelPlan", "RankLayer", "RankedPlan", "advise", "analyze", "gpu", "load_config",
           "plot", "precision", "rank_layers", "roof_tflops", "rules", "table", "to_json"]
