"""What is trained and where: `ModelSpec`, `ClusterSpec`, `ParallelPlan`, presets and recipes.

Pure Python, no torch: the planner imports it in microseconds.
"""

from fivefold.specs.cluster import CLUSTER_PRESETS, ClusterSpec, cluster_preset
from fivefold.specs.flops import forward_flops_per_token, training_flops_per_token
from fivefold.specs.hardware import GPUS, GPUSpec, gpu
from fivefold.specs.model import ModelSpec, param_count
from fivefold.specs.plan import CP_KINDS, SCHEDULES, ParallelPlan
from fivefold.specs.precision import RECIPES, PrecisionRecipe
from fivefold.specs.precision import recipe as precision_recipe
from fivefold.specs.presets import MODEL_PRESETS, model_preset
from fivefold.specs.recipe import Recipe, dump_recipe, load_recipe, recipe_from_dict

__all__ = [
    "CLUSTER_PRESETS",
    "CP_KINDS",
    "GPUS",
    "MODEL_PRESETS",
    "RECIPES",
    "SCHEDULES",
    "ClusterSpec",
    "GPUSpec",
    "ModelSpec",
    "ParallelPlan",
    "PrecisionRecipe",
    "Recipe",
    "cluster_preset",
    "dump_recipe",
    "forward_flops_per_token",
    "gpu",
    "load_recipe",
    "model_preset",
    "param_count",
    "precision_recipe",
    "recipe_from_dict",
    "training_flops_per_token",
]
