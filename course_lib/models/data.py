"""The capstone's corpus and batches: English prose, byte-level tokens (notebook 12).

The corpus, `corpus.txt` beside this module (about 430 kB), is the prose of the Python standard
library's docstrings: `build_corpus()` gathered it once (Python 3.11) from the modules in `MODULES`,
keeping paragraphs of at least 80 characters that are mostly letters (no code examples, no tables),
each once. That text is part of CPython, © Python Software Foundation, under the PSF License Agreement
(https://docs.python.org/3/license.html), which allows redistribution with the notice kept. It ships
with course_lib, so nothing is downloaded and every run reads the same bytes.

Tokens are the text's UTF-8 bytes (vocabulary 256): no tokenizer to train, and a sample is readable
as soon as the model has learnt spelling.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

import torch

from ..checks import check_real

CORPUS = Path(__file__).with_name("corpus.txt")
VOCAB_SIZE = 256

MODULES = (
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal "
    "difflib email enum fractions functools heapq http.client inspect io ipaddress json logging mailbox os pathlib "
    "pickle pprint random shutil smtplib socket statistics string subprocess tarfile tempfile textwrap threading "
    "tkinter turtle typing unittest urllib.parse uuid warnings zipfile zoneinfo pydoc doctest configparser optparse "
    "gettext locale imaplib ftplib nntplib ssl sqlite3 xml.dom.minidom trace pdb cmd codecs queue sched selectors "
    "shlex signal tokenize traceback weakref wave xmlrpc.client zipimport plistlib poplib quopri mimetypes netrc "
    "numbers operator platform profile pstats pyclbr reprlib runpy secrets shelve site sndhdr stringprep symtable "
    "sysconfig tabnanny telnetlib timeit types webbrowser wsgiref.handlers concurrent.futures multiprocessing.pool "
    "http.server http.cookiejar email.message asyncio.tasks asyncio.streams unittest.mock logging.handlers "
    "importlib.metadata dis filecmp fileinput fnmatch glob graphlib hashlib hmac html.parser imghdr linecache lzma "
    "bz2 gzip modulefinder chunk colorsys contextvars copyreg crypt dbm getopt getpass keyword ntpath posixpath "
    "sunau uu xdrlib"
).split()


def build_corpus(modules=MODULES) -> str:
    """Gather the prose paragraphs of the docstrings of `modules` (module, classes, functions,
    methods, in name order). How `corpus.txt` was made; the result depends on the Python version,
    which is why the file is shipped instead of rebuilt."""
    seen, paragraphs = set(), []

    def add(doc):
        for para in re.split(r"\n\s*\n", doc or ""):
            para = para.strip()
            lines = para.splitlines()
            if len(para) < 80 or ">>>" in para or para in seen:
                continue
            if any(line.startswith((" ", "\t")) for line in lines[1:]):
                continue  # indented: code, a table or a list
            if sum(ch.isalpha() or ch == " " for ch in para) < 0.9 * len(para) or not para.isascii():
                continue
            seen.add(para)
            paragraphs.append(re.sub(r" +", " ", " ".join(line.strip() for line in lines)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except Exception:  # a module this Python lacks (removed, or no Tk)
                continue
            add(inspect.getdoc(mod))
            for _, obj in sorted(vars(mod).items()):
                if getattr(obj, "__module__", None) != mod.__name__:
                    continue
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    add(inspect.getdoc(obj))
                if inspect.isclass(obj):
                    for _, method in sorted(vars(obj).items()):
                        if inspect.isfunction(method):
                            add(inspect.getdoc(method))
    return "\n\n".join(paragraphs) + "\n"


def load_corpus() -> str:
    """The shipped corpus as a string (ASCII English prose, about 430 kB)."""
    return CORPUS.read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as an int64 tensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens) -> str:
    """Text of a sequence of byte token ids (invalid UTF-8 shown as U+FFFD)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def split(tokens: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last `val_fraction` of the tokens is held out for validation."""
    val_fraction = check_real("split", "val_fraction", val_fraction, low=0, high=1)
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def get_batch(tokens: torch.Tensor, batch: int, seq_len: int, generator=None, device=None):
    """A random batch of windows: inputs x (batch, seq_len) and targets y = x shifted by one token,
    both int64 on `device`. Windows of seq_len + 1 tokens start uniformly at 0 .. len(tokens) - seq_len - 1
    (the last window ends on the last token). `generator` (a torch.Generator) makes the draw repeatable."""
    if len(tokens) <= seq_len:
        raise ValueError(
            f"get_batch: {len(tokens)} tokens cannot give windows of seq_len + 1 = {seq_len + 1}"
        )
    starts = torch.randint(0, len(tokens) - seq_len, (batch,), generator=generator)  # last: len - seq_len - 1
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]
