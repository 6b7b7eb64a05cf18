"""What is trained and where: `ModelSpec`, `ClusterSpec`, `ParallelPlan`, presets and recipes.

Pure Python, no torch: the planner imports it in microseconds.
"""

from fivefold.spec.cluster import CLUSTER_PRESETS, ClusterSpec, cluster_preset
from fivefold.spec.flops import forward_flops_per_token, training_flops_per_token
from fivefold.spec.hardware import GPUS, GPUSpec, gpu
from fivefold.spec.model import ModelSpec, param_count
from fivefold.spec.plan import CP_KINDS, SCHEDULES, ParallelPlan
from fivefold.spec.precision import RECIPES, PrecisionRecipe
from fivefold.spec.precision import recipe as precision_recipe
from fivefold.spec.presets import MODEL_PRESETS, model_preset
from fivefold.spec.recipe import Recipe, dump_recipe, load_recipe, recipe_from_dict

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
