"""python -m nac_fast.index: encode a folder of images with a trained checkpoint, index it, search
it, and look at what was found.

    python -m nac_fast.index build  --checkpoint runs/default/last.pt --images photos/ --out photos.nacidx
    python -m nac_fast.index build  --checkpoint runs/default/last.pt --images more/ --out photos.nacidx --append
    python -m nac_fast.index search --index photos.nacidx --k 10 --json hits.json --png hits.png query.png queries/
    python -m nac_fast.index encode --checkpoint runs/default/last.pt --images photos/ --out codes.npz --npy codes.npy

build   encodes every image under --images (recursively, symlinked folders followed as in
        training's ImageFolder; the first-level sub-folders are the labels, like an ImageFolder's
        classes; files directly in the folder have none) with the
        checkpoint's own evaluation preprocessing (nac_fast.data.preprocess: recorded in its
        config, not guessed), keeps the first --bits bits of the code, and saves a
        nac_fast.HashIndex with the paths, labels and the checkpoint's path and SHA-256.
        Unreadable images are skipped and reported (count, first names).  --append adds to an
        existing index built from the same checkpoint file (same SHA-256) and bit count only;
        an existing --out is otherwise refused (--overwrite replaces it).
search  encodes the query images (files, or folders scanned as in build) with the checkpoint the
        index records (its SHA-256 must still match), and writes the k nearest of each, with
        their Hamming distances, as JSON (--json FILE, else to stdout) and as a PNG contact
        sheet (--png FILE); an existing --json / --png file is refused (--overwrite replaces
        it).  A query that cannot be read stops the search before anything is written.  k
        larger than the index returns the whole index (a note says so).
encode  the packed codes and paths only (an .npz: "codes" (n, ceil(bits/64)) uint64 words, bit
        j = bit j % 64 of word j // 64, "nbits", "paths", "meta" JSON), for your own search
        stack; --npy FILE also writes the (n, bits) int8 +-1 codes.

Every output is written atomically (a temporary file, then a rename), after all the checks and
the work: a failure leaves no half-written file, and the two outputs of a run (--out and --npy,
--json and --png) are renamed into place only once both are complete.  Output locations are
checked before any work: an existing file (without --overwrite), a folder, a path under a file
or in a folder that cannot be written is refused at once, not after encoding; so is, even with
--overwrite, an output that names one of the run's inputs (the checkpoint, the index searched, a
query image).  Errors are one
line on stderr with exit status 2 (bad arguments, unwritable outputs, unreadable queries,
another checkpoint, ...).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys

import numpy as np

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nac_fast.index",
                                 description="Encode images with a NAC checkpoint, build and "
                                 "search a Hamming index of their codes.", allow_abbrev=False)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{build,search,encode}")

    def common(p, out_help):
        p.add_argument("--checkpoint", required=True, help="train.py checkpoint (e.g. "
                       "runs/default/last.pt)")
        p.add_argument("--images", required=True, help="folder of images (recursive; "
                       "first-level sub-folders are labels)")
        p.add_argument("--out", required=True, help=out_help)
        p.add_argument("--bits", type=int, default=None, help="keep the first K bits of the "
                       "D-bit code (default: D)")
        p.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
        p.add_argument("--which", default="online", choices=("online", "momentum"),
                       help="the online model, or NAC-MQ's momentum model")
        p.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda)")
        p.add_argument("--no-progress", dest="progress", action="store_false",
                       help="no tqdm bar")

    b = sub.add_parser("build", help="encode a folder and save a HashIndex", allow_abbrev=False)
    common(b, "index file to write")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--append", action="store_true", help="add to the existing --out (same "
                   "checkpoint file and bits only)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    s = sub.add_parser("search", help="search an index with query images", allow_abbrev=False)
    s.add_argument("--index", required=True, help="index file written by build")
    s.add_argument("--k", type=int, default=10, help="neighbours per query (more than the index "
                   "holds: all of it)")
    s.add_argument("--json", default=None, help="write the results here (default: stdout)")
    s.add_argument("--png", default=None, help="write a contact sheet PNG here")
    s.add_argument("--overwrite", action="store_true", help="replace an existing --json or "
                   "--png file")
    s.add_argument("--checkpoint", default=None, help="the checkpoint to encode the queries "
                   "with (default: the one the index records; its SHA-256 must match)")
    s.add_argument("--batch-size", type=int, default=256, help="query images per forward pass")
    s.add_argument("--device", default="cpu", help="where the queries are encoded and the index "
                   "searched: cpu, or cuda (the index's codes are copied to the GPU; Triton's "
                   "exact top-k)")
    s.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no tqdm bar")
    s.add_argument("queries", nargs="+", metavar="IMAGE_OR_DIR", help="query images or folders")

    e = sub.add_parser("encode", help="packed codes + paths of a folder (.npz)",
                       allow_abbrev=False)
    common(e, ".npz file to write")
    e.add_argument("--npy", default=None, help="also write the (n, bits) int8 +-1 codes here")
    e.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return ap


class UsageError(ValueError):
    """A bad argument or input: one line on stderr, exit status 2."""


def _positive(flag: str, v: int) -> None:
    if v < 1:
        raise UsageError(f"{flag} must be >= 1, got {v}")


def _check_new_file(flag: str, path: str, overwrite: bool) -> None:
    """An output the run may write: refused (UsageError naming ``flag``) when it exists and
    ``overwrite`` is not given, names a folder, or cannot be written (a parent that is a file, a
    read-only folder, ...: nac_fast._files.check_new_file)."""
    from .._files import check_new_file
    check_new_file(flag, path, overwrite, error=UsageError)


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through links too, when both exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _not_an_input(flag: str, path: str, inputs) -> None:
    """Refuse an output that names one of the run's inputs (``[(what, path), ...]``: the
    checkpoint, the index searched, a query image): --overwrite is for replacing an earlier
    output, and would otherwise let a slip of the keyboard replace a trained checkpoint or the
    index with a PNG, JSON or .npz (after the run read it, so the input is lost)."""
    for what, other in inputs:
        if other is not None and os.path.exists(path) and _same_file(path, other):
            raise UsageError(f"{flag} {path!r} is {what}; name another output file")


def _check_device(flag: str, device):
    from .hash_index import _check_device as check
    try:
        return check(flag, device)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _write_all(items) -> None:
    """``[(flag, path, write, mode), ...]`` written all or none (nac_fast._files.atomic_write_all);
    an OS error at write time (a full disk, ...) is a UsageError naming the flags."""
    from .._files import atomic_write_all
    try:
        atomic_write_all([(path, write, mode) for _, path, write, mode in items])
    except OSError as exc:
        flags = " / ".join(f"{flag} {path!r}" for flag, path, _, _ in items)
        raise UsageError(f"{flags}: cannot write ({exc}); nothing written") from None


def _scan_folder(flag: str, folder: str):
    from .encode import scan_images
    if not os.path.exists(folder):
        raise UsageError(f"{flag} {folder!r}: no such folder")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {folder!r} is not a folder")
    files, labels, ignored = scan_images(folder)
    if not files:
        extra = f" ({len(ignored)} other files)" if ignored else ""
        raise UsageError(f"{flag} {folder!r} holds no image files "
                         f"({', '.join(e.lstrip('.') for e in _exts())}){extra}")
    names = sorted({lab for lab in labels if lab is not None})
    if names and set(names) <= SPLIT_NAMES and any(
            os.path.dirname(os.path.relpath(f, folder)).count(os.sep) >= 1 for f in files):
        print(f"note: {flag} {folder!r}: the labels are its first-level folders "
              f"({', '.join(names)}), which look like the splits of an ImageFolder root; for "
              f"class labels name {os.path.join(folder, names[0])!r}", file=sys.stderr)
    return files, labels, ignored


SPLIT_NAMES = {"train", "val", "test"}


def _exts():
    from ..data.sources.imagefolder import IMAGE_EXTENSIONS
    return IMAGE_EXTENSIONS


def _encoder(args, bits, bits_flag: str = "--bits"):
    """The CodeEncoder of --checkpoint; its errors as UsageErrors naming the flag at fault
    (``bits_flag``: what set ``bits``; --device is checked by the callers first)."""
    from .encode import CodeEncoder
    try:
        return CodeEncoder(args.checkpoint, bits=bits, which=getattr(args, "which", "online"),
                           device=args.device)
    except (ValueError, TypeError, RuntimeError) as exc:
        msg = str(exc)
        flag = ("--device" if msg.startswith("device ") else
                bits_flag if msg.startswith("bits ") else "--checkpoint")
        raise UsageError(f"{flag}: {exc}") from None


def _report_skipped(res, ignored, out=sys.stderr) -> None:
    from .encode import describe_paths
    if res.unreadable:
        print(f"skipped {len(res.unreadable)} unreadable image(s): "
              f"{describe_paths([f'{p} ({e})' for p, e in res.unreadable])}", file=out)
    if ignored:
        print(f"ignored {len(ignored)} file(s) that are not images by extension: "
              f"{describe_paths(ignored, 3)}", file=out)


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------

def cmd_build(args) -> int:
    from .hash_index import HashIndex
    _positive("--batch-size", args.batch_size)
    if args.bits is not None:
        _positive("--bits", args.bits)
    _check_device("--device", args.device)
    existing = None
    if args.append:
        if not os.path.isfile(args.out):
            raise UsageError(f"--append: --out {args.out!r} does not exist (build it first, "
                             "without --append)")
        _check_new_file("--out", args.out, True)  # it is replaced at the end: writable?
        try:
            existing = HashIndex.load(args.out)
        except ValueError as exc:
            raise UsageError(f"--out: {exc}") from None
    else:
        _check_new_file("--out", args.out, args.overwrite)
    _not_an_input("--out", args.out, [("the --checkpoint file", args.checkpoint)])
    files, labels, ignored = _scan_folder("--images", args.images)
    bits = args.bits
    if existing is not None and bits is None:
        bits = existing.nbits
    enc = _encoder(args, bits)
    if existing is not None:
        m = existing.meta
        if m.get("checkpoint_sha256") != enc.meta["checkpoint_sha256"]:
            raise UsageError(f"--append: {args.out!r} was built from checkpoint "
                             f"{m.get('checkpoint')!r} (SHA-256 {str(m.get('checkpoint_sha256'))[:12]}...), "
                             f"not from {args.checkpoint!r} ({enc.meta['checkpoint_sha256'][:12]}...): "
                             "codes of two models cannot share an index")
        if existing.nbits != enc.bits or m.get("which") != enc.which:
            raise UsageError(f"--append: {args.out!r} holds {existing.nbits}-bit codes of the "
                             f"{m.get('which')} model; this run makes {enc.bits}-bit codes of "
                             f"the {enc.which} model")
    res = enc.encode_files(files, batch_size=args.batch_size, progress=args.progress,
                           desc="encoding")
    _report_skipped(res, ignored)
    if not res.files:
        raise UsageError(f"--images {args.images!r}: none of the {len(files)} image files could "
                         "be read; nothing written")
    index = existing if existing is not None else HashIndex(enc.bits, meta=dict(enc.meta))
    index.add(res.codes, paths=res.files, labels=[labels[i] for i in res.kept])
    index.meta["sources"] = index.meta.get("sources", []) + [
        {"images": os.path.abspath(args.images), "added": len(res.files),
         "unreadable": len(res.unreadable)}]
    try:
        index.save(args.out, overwrite=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out!r}: cannot write ({exc}); nothing written") from None
    n_lab = len({lab for lab in index.labels if lab is not None})
    print(f"{'appended' if existing else 'indexed'} {len(res.files)} image(s) "
          f"({len(res.unreadable)} unreadable) -> {args.out}: {index.ntotal} codes of "
          f"{index.nbits} bits, {n_lab} label(s)")
    return 0


# --------------------------------------------------------------------------------------------
# search
# --------------------------------------------------------------------------------------------

def _query_files(items, known=()):
    """The query images and their labels: a folder's first-level sub-folders, as for build; a
    file named on its own takes its folder's name when that is one of the index's labels
    (`known`), so that its neighbours of another label are marked."""
    files, labels = [], []
    for it in items:
        if os.path.isdir(it):
            f, lab, _ = _scan_folder("query folder", it)
            files += f
            labels += lab
        elif os.path.isfile(it):
            files.append(os.path.abspath(it))
            parent = os.path.basename(os.path.dirname(os.path.abspath(it)))
            labels.append(parent if parent in known else None)
        else:
            raise UsageError(f"query {it!r}: no such file or folder")
    return files, labels


def cmd_search(args) -> int:
    from .encode import describe_paths, file_sha256
    from .hash_index import HashIndex
    if args.k < 1:
        raise UsageError(f"--k must be >= 1, got {args.k}")
    _positive("--batch-size", args.batch_size)
    device = _check_device("--device", args.device)
    try:
        index = HashIndex.load(args.index)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(f"--index: {exc}") from None
    if index.ntotal == 0:
        raise UsageError(f"--index {args.index!r} is empty")
    for flag in ("json", "png"):
        path = getattr(args, flag)
        if path is not None:
            _check_new_file(f"--{flag}", path, args.overwrite)
    if args.json is not None and args.png is not None and (
            os.path.abspath(args.json) == os.path.abspath(args.png)):
        raise UsageError("--json and --png name the same file")
    m = index.meta
    ckpt = args.checkpoint or m.get("checkpoint")
    if not ckpt:
        raise UsageError(f"--index {args.index!r} records no checkpoint; pass --checkpoint")
    if args.checkpoint is not None and not os.path.isfile(ckpt):
        # (the user's own --checkpoint: name it, rather than blame the one the index records)
        raise UsageError(f"--checkpoint {ckpt!r}: "
                         + ("a folder, not a checkpoint file" if os.path.isdir(ckpt) else
                            "no such file"))
    if not os.path.isfile(ckpt):
        raise UsageError(f"the checkpoint {ckpt!r} the index was built with is not there; pass "
                         "--checkpoint with a copy of it")
    if m.get("checkpoint_sha256") and file_sha256(ckpt) != m["checkpoint_sha256"]:
        raise UsageError(f"checkpoint {ckpt!r} is not the one {args.index!r} was built with "
                         f"(SHA-256 differs): its codes would not be comparable")
    files, qlabels = _query_files(args.queries, set(index.labels or ()) - {None})
    inputs = [("the --index file", args.index), (f"the checkpoint {ckpt!r}", ckpt)]
    for flag in ("json", "png"):
        path = getattr(args, flag)
        if path is not None:
            _not_an_input(f"--{flag}", path, inputs + [("a query image", f) for f in files])
    if args.png is not None:  # the sheet is drawn in memory: refused now, not after the search
        from .sheet import check_sheet_size
        try:
            check_sheet_size(len(files), min(args.k, index.ntotal))
        except ValueError as exc:
            raise UsageError(f"--png: {exc} (--k; --json has no such limit)") from None
    try:  # a GPU index: its codes copied to the GPU (room checked first), searched there
        index.to(device)
    except ValueError as exc:
        raise UsageError(f"--device {args.device}: {exc}") from None
    args.checkpoint = ckpt
    args.which = m.get("which", "online")
    enc = _encoder(args, index.nbits, bits_flag=f"--index {args.index!r} holds "
                   f"{index.nbits}-bit codes, more than the checkpoint {ckpt!r} makes")
    res = enc.encode_files(files, batch_size=args.batch_size, progress=args.progress,
                           desc="queries")
    if res.unreadable:
        raise UsageError(f"{len(res.unreadable)} query image(s) cannot be read: "
                         f"{describe_paths(f'{p} ({e})' for p, e in res.unreadable)}; "
                         "nothing written")
    k = min(args.k, index.ntotal)
    if k < args.k:
        print(f"note: --k {args.k} is more than the index's {index.ntotal} codes; returning all "
              f"{index.ntotal}", file=sys.stderr)
    try:
        D, I = index.search(res.codes, k)
    except ValueError as exc:  # the search's GPU memory
        raise UsageError(f"--device {args.device}: {exc}") from None
    paths, labels, ids = index.paths, index.labels, index.ids
    queries = []
    for qi, f in enumerate(res.files):
        results = []
        for d, i in zip(D[qi].tolist(), I[qi].tolist()):
            results.append({"path": paths[i] if paths is not None else None,
                            "distance": int(d),
                            "label": labels[i] if labels is not None else None,
                            "id": int(ids[i])})
        queries.append({"query": f, "label": qlabels[qi], "results": results})
    report = {"k": k, "index": os.path.abspath(args.index), "nbits": index.nbits,
              "ntotal": index.ntotal, "checkpoint": os.path.abspath(ckpt),
              "tie_order": "equal distances in index insertion order", "queries": queries}
    text = json.dumps(report, indent=1)
    outputs = []  # both files written all or none
    if args.png:
        from .sheet import contact_sheet
        sheet = contact_sheet(queries, title=f"{os.path.basename(args.index)}: "
                              f"{index.ntotal} codes of {index.nbits} bits, top {k}")
        outputs.append(("--png", args.png, lambda f: sheet.save(f, format="PNG"), "wb"))
    if args.json:
        outputs.append(("--json", args.json, lambda f: f.write(text + "\n"), "w"))
    _write_all(outputs)
    if args.json:
        print(f"wrote {len(queries)} queries x top {k} to {args.json}"
              + (f" and {args.png}" if args.png else ""), file=sys.stderr)
    else:
        print(text)
        if args.png:
            print(f"wrote {args.png}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------

def cmd_encode(args) -> int:
    from ..ops.codes import pack_codes
    _positive("--batch-size", args.batch_size)
    if args.bits is not None:
        _positive("--bits", args.bits)
    _check_device("--device", args.device)
    _check_new_file("--out", args.out, args.overwrite)
    if args.npy is not None:
        _check_new_file("--npy", args.npy, args.overwrite)
        if os.path.abspath(args.npy) == os.path.abspath(args.out):
            raise UsageError("--npy and --out name the same file")
    for flag, path in (("--out", args.out), ("--npy", args.npy)):
        if path is not None:
            _not_an_input(flag, path, [("the --checkpoint file", args.checkpoint)])
    files, _, ignored = _scan_folder("--images", args.images)
    enc = _encoder(args, args.bits)
    res = enc.encode_files(files, batch_size=args.batch_size, progress=args.progress)
    _report_skipped(res, ignored)
    if not res.files:
        raise UsageError(f"--images {args.images!r}: none of the {len(files)} image files could "
                         "be read; nothing written")
    words = pack_codes(res.codes).words.numpy().view(np.uint64)
    meta = json.dumps(dict(enc.meta, layout="bit j of a code = bit j % 64 of word j // 64, set "
                           "for +1; padding bits 0"))

    def write_npz(f):
        buf = io.BytesIO()
        np.savez(buf, codes=words, nbits=np.int64(enc.bits), paths=np.array(res.files),
                 meta=np.array(meta))
        f.write(buf.getvalue())
    outputs = [("--out", args.out, write_npz, "wb")]
    if args.npy is not None:
        pm1 = np.where(res.codes.numpy(), 1, -1).astype(np.int8)
        outputs.append(("--npy", args.npy, lambda f: np.save(f, pm1), "wb"))
    _write_all(outputs)  # both or neither
    print(f"encoded {len(res.files)} image(s) ({len(res.unreadable)} unreadable) -> {args.out}"
          + (f" and {args.npy}" if args.npy else "") + f": {enc.bits} bits")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"build": cmd_build, "search": cmd_search, "encode": cmd_encode}[args.command](args)
    except UsageError as exc:
        print(f"python -m nac_fast.index {args.command}: error: {exc}", file=sys.stderr)
        return 2
