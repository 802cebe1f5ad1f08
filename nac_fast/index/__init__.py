"""Use the codes: a saved Hamming index of packed binary codes, and the command line that builds
it from a checkpoint and a folder of images, searches it and draws what it found.

    index = nac_fast.HashIndex(128); index.add(codes); D, I = index.search(queries, 10)
    python -m nac_fast.index build|search|encode ...            # cli.py (README "Use your codes")

    hash_index.py  HashIndex (FAISS IndexBinaryFlat conventions) and its on-disk format
    encode.py      checkpoint + image files -> codes (the model's own evaluation preprocessing)
    sheet.py       the PNG contact sheet of a search
    cli.py         python -m nac_fast.index
"""
from .hash_index import FORMAT, FORMAT_VERSION, HashIndex

__all__ = ["HashIndex", "FORMAT", "FORMAT_VERSION"]
