"""Checks of token ids against a model's vocabulary, and of a generation against its positions (notebooks
10, 12, 15).

One answer to a model's vocabulary size (`vocab_size`); token ids as Python lists (`token_ids`, `prompt_lists`,
`token_id`; `token_ids_array` with an int64 NumPy copy) and as tensors (`check_token_ids`); a prompt and its new
tokens within the model's positions (`check_generation_fits`).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from .tensors import as_int


def vocab_size(model) -> int | None:
    """A model's vocabulary size where it says (`vocab_size`, `vocab` or `config.vocab_size`), else None: what the
    batcher (notebook 10) and speculative decoding (notebook 15) check token ids and drafts against."""
    for value in (getattr(model, "vocab_size", None), getattr(model, "vocab", None)):
        if isinstance(value, int):
            return value
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def max_positions(model) -> int | None:
    """The most positions a model can run at where it says (`config.max_seq_len`, its RoPE table), else None:
    what `check_generation_fits` checks a prompt and its new tokens against."""
    size = getattr(getattr(model, "config", None), "max_seq_len", None)
    return size if isinstance(size, int) else None


def token_ids(where: str, prompt, vocab: int | None = None) -> list[int]:
    """A prompt as a list of ints in [0, vocab) (any iterable of ids, or a 1-D integer tensor); a TypeError
    when it is not one, a ValueError naming the ids that are not such ints (vocab None: any id >= 0).
    What a server mostly gets, a list of plain ints in range, is checked by builtins (a 32k-token prompt:
    1.7 ms against 9.6 ms for the conversion of each id, on a 2-core CPU)."""
    if type(prompt) is list and prompt and set(map(type, prompt)) == {int}:
        if min(prompt) >= 0 and (vocab is None or max(prompt) < vocab):
            return list(prompt)
    if (ids := _vector_int64(prompt, vocab)) is not None:
        return ids.tolist()
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
        prompt = prompt.tolist()
    if isinstance(prompt, (torch.Tensor, np.ndarray)) and (prompt.ndim != 1 or _floating(prompt)):
        one = " (one sequence: pass prompt[0])" if prompt.ndim == 2 and prompt.shape[0] == 1 else ""
        raise TypeError(
            f"{where}: prompt must be a list of token ids or a 1-D integer tensor, got a tensor of shape "
            f"{tuple(prompt.shape)} and dtype {prompt.dtype}{one}"
        )
    if isinstance(prompt, (str, bytes, torch.Tensor)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"{where}: prompt must be a list of token ids, got {type(prompt).__name__}")
    prompt = list(prompt)  # any iterable, a one-pass iterator too: read once
    ids = [as_int(t) for t in prompt]
    bad = [t for t, i in zip(prompt, ids) if i is None or i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise ValueError(
            f"{where}: prompt token ids must be ints in [0, {vocab or 'vocab size'}); got {bad[:5]}"
        )
    return ids


def token_ids_array(
    where: str, prompt, vocab: int | None = None, as_list: bool = True
) -> tuple[list[int] | None, np.ndarray]:
    """`token_ids`' list and the same ids as an int64 NumPy array (what a serving step feeds the model), with
    its errors. A list is packed into the array in one pass (`struct`'s "q": an int, or an integer type through
    `operator.index` as `token_ids` takes it; a float, a string or an id past int64 fails it), bools are looked
    for only among the ids that read 0 or 1, the range is read from the array, and the list is the array's
    `tolist()` (plain ints). Anything the fast path does not take goes through `token_ids`, for its errors;
    ids past int64 are refused (a ValueError). A 32k-token prompt, with the type of each id read before the
    conversion / here: ids below 32000 1.34 / 0.78 ms, below 256 1.39 / 0.46 (`tolist` makes no new object for
    an int up to 256), every id 0 1.44 / 1.28 (a 2-core CPU, 2026-11-29). as_list=False: (None, the array) where
    the fast path took the list (`tolist` was 0.45 of 0.81 ms at 32k ids below 32000; the batcher makes a request's
    list only if it is read, `Request.prompt`). A 1-D integer tensor or NumPy array is read whole
    (`_vector_int64`)."""
    if type(prompt) is list and prompt and (ids := _packed_int64(prompt, vocab)) is not None:
        return (ids.tolist() if as_list else None), ids
    if (ids := _vector_int64(prompt, vocab)) is not None:
        return (ids.tolist() if as_list else None), ids
    prompt = token_ids(where, prompt, vocab)
    try:
        return prompt, np.asarray(prompt, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{where}: prompt token ids must fit in int64; got {max(prompt)}") from None


def _floating(array) -> bool:
    """Whether a tensor's or a NumPy array's dtype is a floating-point or complex one."""
    if isinstance(array, torch.Tensor):
        return array.is_floating_point() or array.is_complex()
    return array.dtype.kind in "fc"


def _vector_int64(prompt, vocab: int | None) -> np.ndarray | None:
    """A non-empty 1-D integer tensor (any device) or NumPy array, not bool, as an int64 NumPy copy (never a view of
    the caller's memory) if every id lies in [0, vocab) (vocab None: >= 0); else None (`token_ids` says what is
    wrong). What a tokenizer returns with return_tensors: a 32k-token prompt 0.02-0.05 ms here, against 4.6-6.1 ms
    id by id (a 2-core CPU, 2026-12-01)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or not prompt.numel() or prompt.dtype == torch.bool or _floating(prompt):
            return None
        try:
            array = prompt.detach().cpu().numpy()
        except (TypeError, RuntimeError):  # a dtype NumPy has no match for
            return None
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not prompt.size or prompt.dtype.kind not in "iu":
            return None
        array = prompt
    else:
        return None
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        return None
    ids = array.astype(np.int64)  # a copy, whatever the dtype
    if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
        return None
    return ids


def _packed_int64(prompt: list, vocab: int | None) -> np.ndarray | None:
    """`prompt` (a non-empty list) as an int64 array (n,) if every id is an integer, not a bool, in [0, vocab)
    (vocab None: >= 0) and within int64; else None (`token_ids` says what is wrong)."""
    ids = np.empty(len(prompt), dtype=np.int64)
    try:
        struct.pack_into(f"{len(prompt)}q", ids, 0, *prompt)
    except Exception:  # struct.error (not an integer, past int64) or what an id's __index__ raised
        return None
    if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
        return None
    low = np.flatnonzero(ids <= 1)  # True and False pack as 1 and 0
    if low.size:  # the type of each id that reads 0 or 1 (of each id, where they are many: a cheaper pass)
        maybe_bool = prompt if 4 * low.size > len(prompt) else map(prompt.__getitem__, low.tolist())
        if bool in set(map(type, maybe_bool)):
            return None
    return ids


def prompt_lists(where: str, prompts, vocab: int | None = None) -> list[list[int]]:
    """Prompts as lists of ints in [0, vocab): a non-empty list of token-id lists (or 1-D integer tensors),
    none of them empty (`token_ids` checks each); a TypeError or ValueError naming what is wrong."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"{where}: prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = [token_ids(where, p, vocab) for p in prompts]
    if not out or any(len(p) == 0 for p in out):
        raise ValueError(f"{where}: generation needs at least one prompt, and no prompt may be empty")
    return out


def token_id(where: str, name: str, value, vocab: int | None = None) -> int:
    """One token id (an end-of-sequence id, say) as an int in [0, vocab) (vocab None: any id >= 0); else a
    ValueError naming `name`."""
    index = as_int(value)
    if index is None or index < 0 or (vocab is not None and index >= vocab):
        raise ValueError(f"{where}: {name} must be None or a token id of the vocabulary; got {value!r}")
    return index


def check_token_ids(where: str, ids: torch.Tensor, vocab_size: int, ignore: int | None = None) -> None:
    """Token ids (a tensor) must lie in [0, vocab_size) (`ignore`, e.g. cross-entropy's -100, allowed too).
    Checked where the ids are on the CPU only: reading them from a GPU would sync every step (there an id out
    of range is a device-side assert of the embedding)."""
    if ids.device.type != "cpu" or ids.numel() == 0 or torch.compiler.is_compiling():
        return  # (under torch.compile a value check would break the graph)
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore is not None:
        bad &= ids != ignore
    if bool(bad.any()):
        raise ValueError(
            f"{where}: token ids must lie in [0, {vocab_size}) (the vocabulary); got {ids[bad][:5].tolist()}"
        )


def check_generation_fits(
    where: str, prompt_length: int, max_new_tokens: int, max_seq_len: int | None
) -> None:
    """A prompt and `max_new_tokens` new tokens within a model's `max_seq_len` positions (its RoPE table;
    None: no limit), else a ValueError. The model runs at the prompt's positions and at every new
    token's but the last, which is returned, never fed back."""
    positions = prompt_length + max(max_new_tokens - 1, 0)
    if max_seq_len is not None and positions > max_seq_len:
        raise ValueError(
            f"{where}: a prompt of {prompt_length} tokens and {max_new_tokens} new ones run the model at "
            f"{positions} positions (the last new token is not fed back); the model has max_seq_len = "
            f"{max_seq_len}"
        )
