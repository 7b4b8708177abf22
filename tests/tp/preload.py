"""What the ranks of tests/tp import, loaded once into the process they are forked from (``tests.tp.ranks``): a
rank then starts in a fraction of a second rather than the seconds torch, transformers and hfaccel take to import.

Imports only: nothing here runs an operator or starts a thread, so forking afterwards is safe."""

import torch.distributed  # noqa: F401
import transformers.generation  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

import hfaccel  # noqa: F401
import hfaccel.engine  # noqa: F401
import tests.models  # noqa: F401
