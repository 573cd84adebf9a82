"""Writes a trained model in a standard format, for use outside this repository, and reads one back.

hf: for transformers, a GPT-2 (learned positions) or GPT-NeoX (rotary) computing what model.GPT does; onnx: model.onnx,
ids (batch, seq) -> logits (batch, seq, vocab), seq up to block_size. Both write a tokenizer.json; a switch neither
architecture has is refused, never approximated. What each holds, the packages it needs, how to load it: docs/export.md.
"""

import base64
import dataclasses
import importlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from config import UserError, load_config, option
from model import GPT, GPTConfig
from tinygpt import gpt2, system
from tinygpt.files import check_path, checkpoint_path, load_checkpoint, staging_dir, swap_in, write_error
from tinygpt.system import padded_vocab_size
from tinygpt.tokenizer import END_OF_TEXT, load_encoding, tokenizer_from_meta

# model.GPT's module names -> each architecture's; in a block's, blocks.N.part, blocks and part are mapped, N kept.
NAMES = {
    "gpt2": {"wte": "transformer.wte", "wpe": "transformer.wpe", "ln_f": "transformer.ln_f", "lm_head": "lm_head",
             "ln_1": "ln_1", "mixer.c_attn": "attn.c_attn", "mixer.c_proj": "attn.c_proj", "ln_2": "ln_2",
             "ffwd.c_fc": "mlp.c_fc", "ffwd.c_proj": "mlp.c_proj", "blocks": "transformer.h"},
    "gpt_neox": {"wte": "gpt_neox.embed_in", "ln_f": "gpt_neox.final_layer_norm", "lm_head": "embed_out",
                 "ln_1": "input_layernorm", "mixer.c_attn": "attention.query_key_value",
                 "mixer.c_proj": "attention.dense", "ln_2": "post_attention_layernorm",
                 "ffwd.c_fc": "mlp.dense_h_to_4h", "ffwd.c_proj": "mlp.dense_4h_to_h", "blocks": "gpt_neox.layers"},
}
CLASSES = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM"}
VOCAB_ROWS = ("wte.weight", "lm_head.weight")
ROPE_BASE = 10000.0  # model.py's rope_rates' base
LAYERNORM_EPS = 1e-5  # nn.LayerNorm's, which model.py keeps
ACTIVATIONS = {"exact": "gelu", "tanh": "gelu_pytorch_tanh"}  # transformers' names for F.gelu's two
EXPORTED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "model.onnx", "model.onnx.data")  # what an export replaces in --to; anything else there is kept
PACKAGES = {"hf": ("safetensors",), "onnx": ("onnx", "onnxscript")}
# A GPT-NeoX config.json's sizes, as gpt2.SIZE_FIELDS GPT-2's: each a whole number in this range, checked first.
NEOX_SIZES = {"num_hidden_layers": 256, "num_attention_heads": 256, "hidden_size": 1 << 16,
              "max_position_embeddings": 1 << 17, "vocab_size": 1 << 20}


@dataclass
class ExportConfig:
    out_dir: str = option("out/shakespeare_char", "the directory train.py wrote its checkpoints to")
    checkpoint: str = option("", "which checkpoint in out_dir: best.pt (the lowest val loss) or ckpt.pt (the latest); "
                             "empty: best.pt when it exists")
    to: str = option("", "the directory to write the model to")
    format: str = option("hf", "hf (Hugging Face transformers: GPT-2 or GPT-NeoX) or onnx", choices=("hf", "onnx"))
    overwrite: bool = option(False, "replace the files of an export already in --to (other files there are kept)")


@system.cli
def main(argv):
    cfg = load_config(ExportConfig, argv, "-m tinygpt.export", __doc__)
    target = check_paths(cfg)
    path = checkpoint_path(cfg.out_dir, cfg.checkpoint)
    model, tokenizer = read_checkpoint(path)
    arch = architecture(model.config)
    check_packages(cfg.format, tokenizer)
    what = CLASSES[arch] if cfg.format == "hf" else "ONNX"
    print(f"exporting {path} ({model.num_params():,} parameters) to {target} as {what}", flush=True)
    try:
        with staging_dir(target) as stage:  # beside target, renamed into place when whole
            write_tokenizer(stage, tokenizer, model.config)
            if cfg.format == "hf":
                write_hf(stage, model, arch, tokenizer)
            else:
                write_onnx(stage, model)
            swap_in(stage, target, EXPORTED, replace=cfg.overwrite)
    except FileExistsError:  # made by another export since check_paths looked
        raise UserError(f"--to={target} was written by another export while this one ran; it is kept as that one "
                        "left it: pass --overwrite=true to replace it, or pick another --to") from None
    except OSError as e:
        raise UserError(f"{write_error(target, e)}; {target} is as it was") from None
    print(f"wrote {', '.join(sorted(set(os.listdir(target)) & set(EXPORTED)))} to {target}")
    return 0


# --- What can be exported ------------------------------------------------------------------------


def check_paths(cfg):
    """--to as a Path, or a UserError for a target or --out_dir that cannot be used."""
    if not cfg.to:
        raise UserError("no target: pass --to=DIR, the directory to write the model to")
    for flag, path in (("--out_dir", cfg.out_dir), ("--checkpoint", cfg.checkpoint), ("--to", cfg.to)):
        check_path(path, flag, directory=flag != "--checkpoint")
    target = Path(cfg.to)
    if any((target / name).exists() for name in ("ckpt.pt", "best.pt", "lock")):  # swapped out under a run
        raise UserError(f"--to={target} is train.py's out_dir, which an export would swap out under its runs; pick "
                        "another --to")
    if target.exists() and not cfg.overwrite:
        raise UserError(f"--to={target} exists; replace its export with --overwrite=true, or pick another --to")
    return target


def read_checkpoint(path):
    """(model in eval mode on the CPU, tokenizer) of a checkpoint; the attention written out, which traces to ONNX
    (the fused kernel's causal flag would depend on the length)."""
    ckpt = load_checkpoint(path)
    if ckpt.get("iter") == 0:
        print(f"warning: {path} was saved at iteration 0, before any step: the model it holds is untrained")
    try:
        config = GPTConfig(**{**ckpt["model_config"], "dropout": 0.0, "fused_attention": False})
        return gpt2.build(config, ckpt["model"]), tokenizer_from_meta(ckpt["meta"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path} does not fit this version of model.py ({str(e).strip().splitlines()[0][:200]}); "
                        "export it with the code that trained it") from None


def architecture(config):
    """gpt2 or gpt_neox: the standard architecture that computes what config's model computes, or a UserError
    naming the switch that none does."""
    for switch, bad, why in [
        ("mixer", config.mixer != "multihead", "they attend with dot-product heads and a projection (multihead)"),
        ("feedforward", not config.feedforward, "every block of theirs has its feed-forward"),
        ("residual", not config.residual, "they add each sub-layer to the residual stream"),
        ("layernorm", not config.layernorm, "they normalize before each sub-layer"),
        ("score", config.score != "dot", "they score a key by q·k / sqrt(hs)"),
        ("window", config.window != 0, "every query of theirs sees every key before it"),
        ("pos", config.pos not in ("learned", "rope"), "GPT-2 learns its positions, GPT-NeoX turns them (rope)"),
    ]:
        if bad:
            raise UserError(f"cannot export a model with {switch}={getattr(config, switch)}: GPT-2 and GPT-NeoX "
                            f"cannot compute it ({why}); only the full GPT with learned or rope positions exports")
    return "gpt2" if config.pos == "learned" else "gpt_neox"


def check_packages(fmt, tokenizer):
    """A UserError for an optional package that writing needs and this Python lacks, before anything is written."""
    needed = PACKAGES[fmt] + (("transformers",) if tokenizer.kind == "tiktoken" else ())  # its tiktoken converter
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(f"--format={fmt} needs the optional package {name}: pip install {' '.join(needed)}") \
                from None


# --- Hugging Face -------------------------------------------------------------------------------


def hf_name(name, arch):
    """model.GPT's tensor name -> arch's: blocks.3.mixer.c_attn.weight -> transformer.h.3.attn.c_attn.weight."""
    module, _, kind = name.rpartition(".")
    if module.startswith("blocks."):
        blocks, n, part = module.split(".", 2)
        return f"{NAMES[arch][blocks]}.{n}.{NAMES[arch][part]}.{kind}"
    return f"{NAMES[arch][module]}.{kind}"


def hf_layout(tensor, name, arch, n_head, inverse=False):
    """model.GPT's tensor `name` laid out as arch's: GPT-2's matrices transposed (Conv1D), GPT-NeoX's c_attn rows,
    ours (q, k, v) x heads, as heads x (q, k, v); inverse: back."""
    if arch == "gpt2" and name.endswith(gpt2.CONV1D):
        return tensor.t()
    if arch == "gpt_neox" and ".c_attn." in name:
        return tensor.unflatten(0, (n_head, 3, -1) if inverse else (3, n_head, -1)).transpose(0, 1).flatten(0, 2)
    return tensor


def hf_state(model, arch):
    """arch's tensors holding model's weights: renamed, the padding rows of the vocabulary cut, GPT-2's matrices
    transposed (Conv1D), GPT-NeoX's q, k, v side by side per head, and zeros for biases ours has not."""
    config, state = model.config, model.state_dict()
    with torch.device("meta"):
        full = GPT(dataclasses.replace(config, bias=True)).state_dict()
    tensors = {}
    for name, like in full.items():
        if name == "lm_head.weight" and config.tie_weights:
            continue  # the embedding's matrix: transformers ties it again
        tensor = state[name] if name in state else torch.zeros(like.shape)  # a bias adding 0
        if name in VOCAB_ROWS:
            tensor = tensor[: config.real_vocab_size or config.vocab_size]
        tensors[hf_name(name, arch)] = hf_layout(tensor, name, arch, config.n_head).detach().float().contiguous()
    return tensors


def hf_config(config, arch, eos):
    """config.json: the architecture's names for model.GPT's sizes, and what transformers would default otherwise."""
    act, vocab = ACTIVATIONS[config.gelu], config.real_vocab_size or config.vocab_size
    common = {"architectures": [CLASSES[arch]], "model_type": arch, "vocab_size": vocab, "dtype": "float32",
              "tie_word_embeddings": config.tie_weights, "bos_token_id": eos, "eos_token_id": eos}
    if arch == "gpt2":
        return common | {"n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
                         "n_positions": config.block_size, "activation_function": act,
                         "layer_norm_epsilon": LAYERNORM_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    rope = {"rope_type": "default", "rope_theta": ROPE_BASE, "partial_rotary_factor": 1.0}
    return common | {"hidden_size": config.n_embd, "num_hidden_layers": config.n_layer,
                     "num_attention_heads": config.n_head, "intermediate_size": 4 * config.n_embd, "hidden_act": act,
                     "max_position_embeddings": config.block_size, "layer_norm_eps": LAYERNORM_EPS,
                     "use_parallel_residual": False, "attention_bias": True, "rope_parameters": rope,
                     "rotary_pct": 1.0, "rotary_emb_base": ROPE_BASE,  # transformers 4's names for the same
                     "hidden_dropout": 0.0, "attention_dropout": 0.0}


def write_hf(stage, model, arch, tokenizer):
    from safetensors.torch import save

    eos = getattr(tokenizer, "eot_token", None)  # characters have none: no real character may end a generation
    (stage / "model.safetensors").write_bytes(save(hf_state(model, arch), metadata={"format": "pt"}))
    write_json(stage / "config.json", hf_config(model.config, arch, eos))
    write_json(stage / "generation_config.json", {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos})


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- Tokenizers -----------------------------------------------------------------------------------


def char_tokenizer(chars):
    """tokenizer.json for one token per character: a BPE without merges reads each character as a token, and
    Fuse decodes them without spaces between. A character outside the vocabulary is dropped (no unknown token)."""
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {ch: i for i, ch in enumerate(chars)}, "merges": []}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "Fuse"}, "model": model}


def bpe_tokenizer(encoding, stage):
    """tokenizer.json of a tiktoken encoding, by transformers' own converter (it reads the ranks from a file)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = stage / "ranks.tiktoken"
    ranks.write_bytes(b"".join(base64.b64encode(token) + b" %d\n" % rank
                               for token, rank in encoding._mergeable_ranks.items()))
    try:
        converted = TikTokenConverter(str(ranks), encoding._pat_str, extra_special_tokens=encoding._special_tokens)
        return json.loads(converted.converted().to_str())
    except Exception as e:  # the tokenizers library raises plain Exceptions (a pattern it cannot compile, ...)
        raise UserError(f"tiktoken encoding {encoding.name!r} cannot be written as a tokenizer.json "
                        f"({str(e)[:100]}); export with --format=onnx and tokenize with tiktoken") from None
    finally:
        ranks.unlink()


def write_tokenizer(stage, tokenizer, config):
    chars = tokenizer.kind == "char"
    write_json(stage / "tokenizer.json", char_tokenizer(tokenizer.chars) if chars else
               bpe_tokenizer(tokenizer.encoding, stage))
    special = {} if chars else {"tiktoken_encoding": tokenizer.encoding.name}  # which tokens, for load() to read
    special |= {} if chars or tokenizer.eot_token is None else {"eos_token": END_OF_TEXT}
    write_json(stage / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                                 "clean_up_tokenization_spaces": False,  # " ." stays " ."
                                                 "model_max_length": config.block_size} | special)


# --- ONNX -------------------------------------------------------------------------------------------


def write_onnx(stage, model):
    """model.onnx: ids (batch, seq) -> logits (batch, seq, vocab), traced by torch.export with both axes free."""
    T = model.config.block_size
    axes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=T)}
    with warnings.catch_warnings(), gpt2.quiet("torch.onnx"), gpt2.quiet("torch.export"):
        warnings.simplefilter("ignore")  # the exporter's notes on what it skips (the loss, None here)
        program = torch.onnx.export(model, (torch.zeros(2, T, dtype=torch.long),), dynamo=True, verbose=False,
                                    input_names=["ids"], output_names=["logits"], dynamic_shapes=(axes,))
    program.save(str(stage / "model.onnx"))


# --- Back in: a Hugging Face directory as a model.GPT -----------------------------------------------


def load(init_from):
    """(GPTConfig, state dict, tokenizer meta) of GPT-2 from the hub (a name in gpt2.SIZES) or a Hugging Face directory:
    OpenAI's GPT-2, or an export's GPT-2 or GPT-NeoX; its tokens are an export's characters, else tiktoken's gpt2."""
    directory = gpt2.download(init_from) if init_from in gpt2.SIZES else Path(init_from)
    hf, chars = gpt2.read_config(directory), read_chars(directory / "tokenizer.json")
    kind = hf.get("model_type") if isinstance(hf, dict) else "gpt2"  # gpt_config says what else it holds
    if kind not in ("gpt2", "gpt_neox"):
        raise UserError(f"{init_from}: config.json's model_type {kind!r} is not gpt2 or gpt_neox: only GPT-2 models, "
                        "and the GPT-2 and GPT-NeoX models python -m tinygpt.export writes, load here")
    config = neox_config(hf, init_from) if kind == "gpt_neox" else gpt2.gpt_config(hf, init_from)
    try:  # an export's tokenizer_config.json names its BPE; one missing, damaged or not an object names none
        exported = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        exported = None
    exported = exported if isinstance(exported, dict) else {}
    encoding = exported.get("tiktoken_encoding")
    if not chars and encoding not in (None, "gpt2"):
        raise UserError(f"{init_from} reads tiktoken's {encoding!r} tokens: only GPT-2's (tiktoken's gpt2), or the "
                        "characters of an export's tokenizer.json, load here; use its ONNX export with tiktoken")
    if not chars and exported and encoding is None and config.real_vocab_size != gpt2.VOCAB_SIZE:  # characters
        raise UserError(f"{init_from} has {config.real_vocab_size:,} tokens and no tokenizer.json of characters: only "
                        f"GPT-2's {gpt2.VOCAB_SIZE:,} tokens, or an export's characters, load here; export it again")
    if chars:
        n, vocab, meta = len(chars), "its tokenizer.json", {"tokenizer": "char", "vocab": chars}
    else:
        n, vocab = load_encoding("gpt2").n_vocab, "tiktoken's gpt2"
        meta = {"tokenizer": "tiktoken", "encoding": "gpt2", "vocab_size": n}
    if n != config.real_vocab_size:
        raise UserError(f"{init_from} has a vocabulary of {config.real_vocab_size} tokens and {vocab} {n}; only "
                        "models with GPT-2's vocabulary, or the characters of their tokenizer.json, load here")
    return config, gpt_state(gpt2.read_weights(directory), config, kind, init_from), meta


def read_chars(path):
    """The vocabulary of a character tokenizer.json (char_tokenizer's), in id order; None for any other."""
    tok = gpt2.read_json(path, "export the model again") if path.is_file() else {}
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or model.get("merges") != [] or tok.get("decoder") != {"type": "Fuse"}:
        return None
    vocab = model.get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else [None]
    if any(type(i) is not int for i in ids) or sorted(ids) != list(range(len(ids))) or any(len(c) != 1 for c in vocab):
        raise UserError(f"{path}: its vocabulary is not one character per id 0, 1, 2, ...; export the model again")
    return sorted(vocab, key=vocab.get)


def neox_config(hf, source):
    """The GPTConfig of a GPT-NeoX config.json, or a UserError for what model.GPT cannot compute."""
    gpt2.check_sizes(hf, NEOX_SIZES, source)
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    n_embd = hf["hidden_size"]
    for key, bad in {  # unlike model.py's: sequential residuals, every channel turned at rope_rates', 4x MLP
        "use_parallel_residual": hf.get("use_parallel_residual", True),
        "attention_bias": hf.get("attention_bias", True) is not True,  # without, no bias tensors to read
        "partial_rotary_factor": rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)) != 1,
        "rope_theta": rope.get("rope_theta", hf.get("rotary_emb_base", ROPE_BASE)) != ROPE_BASE,
        "rope_type": rope.get("rope_type", "default") != "default",
        "hidden_act": str(hf.get("hidden_act", "gelu")) not in gpt2.GELU,
        "intermediate_size": hf.get("intermediate_size") != 4 * n_embd,
        "layer_norm_eps": hf.get("layer_norm_eps", LAYERNORM_EPS) != LAYERNORM_EPS,
    }.items():
        if bad:
            raise UserError(f"{source}: config.json's {key} is not what model.py computes; only GPT-NeoX models "
                            "that python -m tinygpt.export writes load here")
    try:
        vocab = hf["vocab_size"]
        return GPTConfig(vocab_size=padded_vocab_size(vocab), real_vocab_size=vocab, n_embd=n_embd,
                         block_size=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
                         n_head=hf["num_attention_heads"], pos="rope", bias=True, dropout=0.0,
                         tie_weights=hf.get("tie_word_embeddings", False), gelu=gpt2.GELU[hf.get("hidden_act", "gelu")])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source}: config.json does not describe a GPT-NeoX ({type(e).__name__}: {e})") from None


def gpt_state(tensors, config, arch, source):
    """model.GPT's state dict for config from arch's tensors: hf_state, undone, the vocabulary's rows padded again."""
    if arch == "gpt2":  # OpenAI's files name their tensors without transformer. and keep the causal mask as a buffer
        tensors = {("" if n.startswith(("transformer.", "lm_head.")) else "transformer.") + n: t
                   for n, t in tensors.items() if not n.endswith((".attn.bias", ".attn.masked_bias"))}
    with torch.device("meta"):  # the names and shapes, without allocating the weights
        expected = GPT(config).state_dict()
    state = {}
    for name, like in expected.items():
        if name == "lm_head.weight" and config.tie_weights:
            state[name] = state["wte.weight"]
            continue
        theirs = hf_name(name, arch)
        if theirs not in tensors:
            fix = gpt2.AGAIN if arch == "gpt2" else "export the model again"
            raise UserError(f"{source} has no weights for {theirs}; {fix}")
        tensor = hf_layout(tensors[theirs], name, arch, config.n_head, inverse=True)
        if name in VOCAB_ROWS:  # padded to the embedding's round size: padding tokens never occur
            tensor = torch.cat([tensor, tensor.new_zeros(max(like.size(0) - tensor.size(0), 0), *tensor.shape[1:])])
        if tensor.shape != like.shape:
            raise UserError(f"{source}: {theirs} is {tuple(tensor.shape)}, config.json says {tuple(like.shape)}")
        state[name] = tensor.float().contiguous()
    unexpected = sorted(set(tensors) - {hf_name(name, arch) for name in expected})
    if unexpected and arch == "gpt2":
        raise UserError(f"{source} has weights GPT-2 has not ({unexpected[0]}, ...); only GPT-2 models load here")
    if unexpected:  # a config.json that says fewer layers (or no bias) than the weights hold
        raise UserError(f"{source} has weights its config.json has not ({unexpected[0]}, ...): config.json was edited "
                        "after the export; export the model again")
    return state


if __name__ == "__main__":
    raise SystemExit(main())
