"""The documentation's screenshots (docs/images/) from those the browser tests take.

`make screenshots` runs the browser tests named in the Makefile with ROLLOUT_LENS_TEST_ARTIFACTS
pointing at a fresh folder, then `python -m tests.screenshots FOLDER docs/images` copies the chosen
set, each page cut to its top where the whole page is too tall to read in the docs. The images
are committed: the site then builds offline in two seconds, without a browser, and the README's
picture shows on the forge's front page.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

# docs/images/NAME: (the browser test's screenshot, the height in pixels it is cut to or None).
CHOSEN: dict[str, tuple[str, int | None]] = {
    "runs-page.png": ("runs.png", None),
    "run-page.png": ("run-collapse.png", 1500),
    "step-groups.png": ("step-groups.png", None),
    "group-page.png": ("group-page.png", None),
    "group-multiturn.png": ("stepview-multiturn-group.png", None),
    "group-log-ratio.png": ("stepview-ratio.png", 860),
    "mismatch.png": ("mismatch-range.png", 1500),
    "explorer.png": ("explorer.png", None),
    "launch-form.png": ("launch-form.png", 1080),
}

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # PNG colour type: samples a pixel (8-bit, no palette)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    if not data.startswith(SIGNATURE):
        raise ValueError("not a PNG file")
    chunks, at = [], len(SIGNATURE)
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        chunks.append((data[at + 4 : at + 8], data[at + 8 : at + 8 + length]))
        at += 12 + length
    return chunks


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def cut_to_height(data: bytes, height: int) -> bytes:
    """The PNG's top `height` rows. Each row's filter refers only to the rows above it, so the
    top rows need no unfiltering: the image data is cut after them. Playwright writes 8-bit,
    non-interlaced RGB(A) screenshots; any other PNG is refused."""
    chunks = _chunks(data)
    header = chunks[0][1]
    width, old_height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in CHANNELS or interlace:
        raise ValueError(f"an 8-bit non-interlaced PNG is needed (depth {depth}, type {colour})")
    if height >= old_height:
        return data
    rows = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    kept = rows[: height * (1 + width * CHANNELS[colour])]
    header = struct.pack(">II", width, height) + header[8:]
    return (
        SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(kept, 9))
        + _chunk(b"IEND", b"")
    )


def copy_chosen(shots: Path, images: Path) -> list[str]:
    """Copy the chosen screenshots from `shots` into `images`; the names it wrote."""
    missing = [source for source, _ in CHOSEN.values() if not (shots / source).is_file()]
    if missing:
        raise SystemExit(f"{shots} lacks {', '.join(missing)}: did the browser tests run?")
    for name, (source, height) in CHOSEN.items():
        data = (shots / source).read_bytes()
        (images / name).write_bytes(data if height is None else cut_to_height(data, height))
    return sorted(CHOSEN)


def main(argv: list[str]) -> None:
    shots, images = (Path(a) for a in argv)
    for name in copy_chosen(shots, images):
        print(images / name)


if __name__ == "__main__":
    main(sys.argv[1:])
