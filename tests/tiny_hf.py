"""Tiny randomly initialised Hugging Face causal LMs and a character tokenizer, built offline from configs."""

from __future__ import annotations

import torch

VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
    "And God called the light Day, and the darkness he called Night.",
    "And the evening and the morning were the first day.",
    "And God said, Let there be a firmament in the midst of the waters.",
    "And God made the firmament, and divided the waters.",
    "And God called the firmament Heaven.",
    "And God said, Let the waters under the heaven be gathered together unto one place.",
    "And God called the dry land Earth; and the gathering together of the waters called he Seas.",
    "And the earth brought forth grass, and herb yielding seed after his kind.",
]
CHARS = sorted(set("".join(VERSES)) | set("\n"))


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (``[UNK]`` = 0, ``[PAD]`` = 1)."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]")


def tiny_causal_lm(arch: str, seed: int = 0, layers: int = 2, d: int = 16):
    """A random ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (float32, eval mode) over the character vocabulary."""
    import transformers

    vocab = len(CHARS) + 2
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=d,
            intermediate_size=2 * d,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=d,
            n_layer=layers,
            n_head=2,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.config.use_cache = False
    return model


def save_checkpoint(model, path) -> None:
    """``save_pretrained`` of the model and of :func:`char_tokenizer` into ``path``."""
    model.save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
