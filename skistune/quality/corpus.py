"""The text quality is measured on: every Python install has it, so anyone can rerun a quality profile.

Corpus: the module docstrings of a fixed list of standard-library modules (`MODULES`, those that have one,
in that order), joined by blank lines and tokenized with the model's tokenizer, then cut into consecutive
windows of ``window_tokens``. Even-numbered windows build the profile; odd-numbered ones are held out for
validating recommended configs, so a validation never scores text the profile was built on. Docstrings
change between Python versions: the corpus description carries the version and a hash of the token ids,
and a profile measured on another corpus says so when it is compared.
"""
from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass

MODULES = (
    "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "calendar", "cmd", "codecs", "collections",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "datetime", "decimal", "difflib",
    "doctest", "email", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html",
    "http.client", "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress", "json", "locale",
    "logging", "lzma", "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "pdb",
    "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "quopri",
    "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib",
    "socket", "socketserver", "statistics", "string", "struct", "subprocess", "symtable", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing",
    "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
    "zipfile", "zipimport",
)
SPLITS = ("profile", "heldout")


def stdlib_text() -> tuple[str, list[str]]:
    """The joined module docstrings and the modules that had one."""
    docs, used = [], []
    for name in MODULES:
        doc = importlib.import_module(name).__doc__
        if doc and doc.strip():
            docs.append(doc.strip())
            used.append(name)
    return "\n\n".join(docs), used


@dataclass(frozen=True)
class Corpus:
    """The tokenized corpus cut into windows; ``split`` windows are every other one (see the module doc)."""

    token_ids: tuple[int, ...]
    modules: tuple[str, ...]
    window_tokens: int

    @classmethod
    def stdlib(cls, tokenizer, window_tokens: int = 1024) -> "Corpus":
        if window_tokens < 64:
            raise ValueError(f"window_tokens {window_tokens}: windows shorter than 64 tokens say little")
        text, used = stdlib_text()
        return cls(tuple(tokenizer.encode(text)), tuple(used), window_tokens)

    @property
    def num_windows(self) -> int:
        return len(self.token_ids) // self.window_tokens

    def windows(self, split: str, count: int) -> list[list[int]]:
        """The first ``count`` windows of ``split`` (profile: windows 0, 2, 4, ...; heldout: 1, 3, 5, ...)."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: one of {', '.join(SPLITS)}")
        first = SPLITS.index(split)
        available = len(range(first, self.num_windows, 2))
        if count > available:
            raise ValueError(f"{count} {split} windows asked, the corpus has {available} of {self.window_tokens} "
                             "tokens")
        n = self.window_tokens
        return [list(self.token_ids[i * n:(i + 1) * n]) for i in range(first, first + 2 * count, 2)]

    def describe(self) -> dict:
        digest = hashlib.sha256(",".join(map(str, self.token_ids)).encode()).hexdigest()[:16]
        return {"source": "Python standard-library module docstrings (skistune.quality.corpus.MODULES)",
                "python": sys.version.split()[0], "modules": len(self.modules), "tokens": len(self.token_ids),
                "sha256_16": digest, "window_tokens": self.window_tokens,
                "splits": "profile = even windows, heldout = odd windows"}
