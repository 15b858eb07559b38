from llmserve.config import ModelConfig
from llmserve.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm) share one decoder; the config's flags differ.
MODEL_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}


def build_model(config: ModelConfig):
    return MODEL_REGISTRY[config.architecture](config)
