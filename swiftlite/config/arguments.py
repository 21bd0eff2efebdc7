"""One dataclass per command, each composed from shared groups (one module each):

  group        module                   in
  model        config.model_args        every command that loads a model
  data         config.data_args         sft, rlhf
  tuner        config.tuner_args        sft, rlhf
  train        config.train_args        sft, rlhf
  generation   config.generation_args   infer, eval (and the engine's defaults)
  backend      config.vllm_args         deploy, eval (pt or vLLM)

CLI flags, YAML/JSON config files, Web-UI forms and Python keyword arguments all build these
same objects, with the same names; swiftlite.config.parsing turns names and values into them.
Each command's own dataclass lives in config/<command>_args.py; this module is their index.
"""
from swiftlite.config.data_args import DataArguments
from swiftlite.config.deploy_args import DEPLOY_PT_BATCH, DeployArguments
from swiftlite.config.estimate_args import EstimateArguments
from swiftlite.config.eval_args import EvalArguments
from swiftlite.config.export_args import ExportArguments
from swiftlite.config.fields import arg
from swiftlite.config.generation_args import GenerationArguments
from swiftlite.config.infer_args import InferArguments
from swiftlite.config.merge_args import MergeArguments
from swiftlite.config.model_args import ModelArguments, PlacementArguments
from swiftlite.config.rlhf_args import RlhfArguments
from swiftlite.config.sft_args import QUANT_ZERO3, SftArguments
from swiftlite.config.train_args import TrainArguments
from swiftlite.config.tuner_args import LoraArguments

__all__ = ["DEPLOY_PT_BATCH", "QUANT_ZERO3", "DataArguments", "DeployArguments",
           "EstimateArguments", "EvalArguments", "ExportArguments", "GenerationArguments",
           "InferArguments",
           "LoraArguments", "MergeArguments", "ModelArguments", "PlacementArguments",
           "RlhfArguments", "SftArguments", "TrainArguments", "arg"]
