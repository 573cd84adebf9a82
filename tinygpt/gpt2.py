"""OpenAI's GPT-2, from the Hugging Face hub or a directory in its layout, as a model.GPT (docs/finetuning.md).

GPT-2 is model.py's GPT with biases, learned positions over 1024 tokens, a tied head and the tanh GELU; its text goes
through tiktoken's gpt2 encoding. Weights are tensors, never code: safetensors, or a pytorch_model.bin read with
torch.load(weights_only=True). Downloading needs the optional packages huggingface_hub and safetensors.
"""

import contextlib
import json
import logging
from pathlib import Path

import torch

from config import UserError
from model import GPT, GPTConfig
from tinygpt.files import load_tensors
from tinygpt.system import padded_vocab_size
from tinygpt.tokenizer import load_encoding

SIZES = {"gpt2": "124M", "gpt2-medium": "350M", "gpt2-large": "774M", "gpt2-xl": "1.5B"}  # parameters
VOCAB_SIZE = 50257  # tiktoken's gpt2 encoding's tokens
INSTALL = "pip install huggingface_hub safetensors"
AGAIN = "get the model again (download it, or export it again)"  # a directory may be the hub's, or an export's
# Hugging Face's names for GELU: "gelu" is the exact one; the others compute the tanh approximation.
GELU = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
# Hugging Face's GPT-2 stores its matrices as Conv1D, (in, out): transposed from nn.Linear's (out, in).
CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def is_gpt2(init_from):
    """Whether init_from names GPT-2: one of SIZES, or a directory in the hub's layout."""
    return init_from in SIZES or Path(init_from).is_dir()


# --- Finding the files ---------------------------------------------------------------------


@contextlib.contextmanager
def quiet(logger_name):
    """The hub logs each retry as a warning; the one error line says it all."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def download(name):
    """The directory in the hub's cache holding `name`'s config.json and model.safetensors."""
    load_encoding("gpt2")  # first: without its tokenizer, a download of the weights is of no use
    try:
        from huggingface_hub import hf_hub_download  # imported before quiet(): importing sets the hub's log level
    except ImportError:
        raise UserError(f"--init_from={name} downloads GPT-2 from the Hugging Face hub, which needs optional packages: "
                        f"{INSTALL}; or pass a directory holding its config.json and model.safetensors") from None
    repo = f"openai-community/{name}"  # the hub's home of OpenAI's checkpoints
    try:
        with quiet("huggingface_hub"):
            paths = [hf_hub_download(repo, f) for f in ("config.json", "model.safetensors")]
    except (OSError, ValueError) as e:  # the hub's errors (offline, not found, HTTP) are OSErrors
        raise UserError(f"could not get {repo} from the Hugging Face hub ({type(e).__name__}) and it is not in its "
                        f"cache: connect once to download it ({SIZES[name]} parameters), or pass --init_from=DIR, "
                        "a directory holding its config.json and model.safetensors") from None
    return Path(paths[0]).parent


def read_config(directory):
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{path} not found: a GPT-2 directory holds config.json and model.safetensors")
    return read_json(path, AGAIN)


def read_json(path, fix):
    """The JSON in path, or a UserError naming it and, for a file that is no JSON, the fix."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    except (ValueError, RecursionError):  # not UTF-8 (a ValueError), not JSON, or nested past what json follows
        raise UserError(f"{path} is not valid JSON; {fix}") from None


def read_weights(directory):
    """The tensors in model.safetensors, else pytorch_model.bin (plain tensors only)."""
    path = directory / "model.safetensors"
    if path.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(f"reading {path} needs the optional package safetensors: pip install safetensors") from None
        try:
            return load_file(path)
        except Exception as e:  # safetensors raises its own SafetensorError for a bad file
            raise UserError(f"{path} is not a readable safetensors file ({str(e)[:100]}); {AGAIN}") from None
    path = directory / "pytorch_model.bin"
    if not path.is_file():
        raise UserError(f"{directory} has neither model.safetensors nor pytorch_model.bin (sharded weights "
                        f"are not supported); {AGAIN}")
    return load_tensors(path, "a weights file", AGAIN, "Use a model.safetensors")


# --- Mapping GPT-2 onto model.GPT ---------------------------------------------------------------


# config.json's sizes, each a whole number in this range: past it, no GPT-2 (1.5B: 48 x 1600, 1024 positions)
SIZE_FIELDS = {"n_layer": 256, "n_head": 256, "n_embd": 1 << 16, "n_positions": 1 << 17, "vocab_size": 1 << 20}


def check_sizes(hf, limits, source):
    """A UserError unless config.json (hf) is an object whose sizes in limits are each from 1 to their limit."""
    if not isinstance(hf, dict):
        raise UserError(f"{source}: config.json holds a JSON {type(hf).__name__}, not an object; get the model again")
    for key, most in limits.items():
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise UserError(f"{source}: config.json's {key} must be a whole number from 1 to {most:,}, got {value!r}")


def gpt_config(hf, source):
    """The GPTConfig of a Hugging Face GPT-2 config.json, or a UserError for what GPT can not be."""
    check_sizes(hf, SIZE_FIELDS, source)  # before anything that size is made
    n_embd = hf["n_embd"]
    if n_embd % hf["n_head"]:
        raise UserError(f"{source}: config.json's n_embd ({n_embd}) is not a multiple of n_head ({hf['n_head']})")
    for key, bad in {  # True where config.json is not GPT-2's (export.load has checked its model_type)
        "activation_function": str(hf.get("activation_function", "gelu_new")) not in GELU,
        "n_inner": hf.get("n_inner") not in (None, 4 * n_embd),
        "layer_norm_epsilon": hf.get("layer_norm_epsilon", 1e-5) != 1e-5,  # nn.LayerNorm's
        "scale_attn_weights": not hf.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": hf.get("scale_attn_by_inverse_layer_idx", False),
        "add_cross_attention": hf.get("add_cross_attention", False),
    }.items():
        if bad:
            raise UserError(f"{source}: {key} {hf.get(key)!r} is not GPT-2's; only GPT-2 models load here")
    vocab_size = hf["vocab_size"]
    try:  # a check model.py adds later is still one error line
        return GPTConfig(vocab_size=padded_vocab_size(vocab_size), real_vocab_size=vocab_size,
                         block_size=hf["n_positions"], n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=n_embd,
                         dropout=0.0, bias=True, pos="learned", tie_weights=hf.get("tie_word_embeddings", True),
                         gelu=GELU[hf.get("activation_function", "gelu_new")])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source}: config.json does not describe a GPT-2 ({type(e).__name__}: {e})") from None


def build(config, state):
    """model.GPT holding state, in eval mode, without first filling a random model as large (on the meta device);
    rotary and sinusoidal positions are built on the CPU, where their buffers, computed, not loaded, are made."""
    with torch.device("meta" if config.pos in ("learned", "none") else "cpu"):
        model = GPT(config)
    model.load_state_dict(state, assign=True)
    if config.tie_weights:
        model.lm_head.weight = model.wte.weight  # assign gave each name its own Parameter: tie them again
    return model.eval()
