"""What crosses from the trainers to the rollout ranks, as bytes: a bucket of named tensors packed into one flat
buffer (each tensor aligned, cast to the engine's dtype) with its layout, framed for a broadcast; which slice of
a job each rollout rank generates; a job's images as PNG bytes, once per group (:func:`encode_job_images`), and
their digest (a job written ahead is the step's own only if its images are the step's). Pure functions (no process
group)."""

from __future__ import annotations

import hashlib
import math
import pickle

import torch

from trl_nrollout.rollout.ranks.weight_delta import DeltaHeader

_ALIGN = 16  # byte alignment of each tensor in a bucket's flat buffer (a view as any dtype needs it)


def job_slice(total: int, n: int, rollout_ranks: int, tp: int, r: int) -> tuple[int, int]:
    """Samples ``[start, stop)`` of a job of ``total`` samples (groups of ``n``) that rollout rank ``r`` hands its
    engine: each of the ``rollout_ranks / tp`` engines takes a contiguous run of whole groups (their counts differ
    by at most one), split evenly among its ``tp`` ranks (a group may span them, as in a colocated engine)."""
    engines = rollout_ranks // tp
    groups = total // n
    e, t = divmod(r, tp)
    g0, g1 = e * groups // engines, (e + 1) * groups // engines
    first, count = g0 * n, (g1 - g0) * n
    return first + count * t // tp, first + count * (t + 1) // tp


def images_digest(groups: list[list] | None) -> str | None:
    """A digest of a job's images ``[groups][images of the group]`` (PIL images, arrays, anything picklable): equal
    for equal pixels, modes, sizes and order, group by group; None for a job without images."""
    if groups is None:
        return None
    h = hashlib.blake2b(digest_size=16)
    for imgs in groups:
        h.update(f"group of {len(imgs or [])};".encode())
        for img in imgs or []:
            data = img.tobytes() if hasattr(img, "tobytes") else pickle.dumps(img, protocol=4)
            meta = (type(img).__name__, getattr(img, "mode", None), getattr(img, "size", None),
                    tuple(getattr(img, "shape", ())), str(getattr(img, "dtype", "")), len(data))
            h.update(repr(meta).encode())
            h.update(data)
    return h.hexdigest()


#: the first bytes of a PNG file (a job's image payloads: :func:`encode_job_images`)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: the PIL modes a PNG file writes and reads back unchanged
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")


def encode_job_images(groups: list[list] | None) -> list[list] | None:
    """A job's images ``[groups][images of the group]`` as the rollout ranks receive them: each PIL image as its PNG
    file's bytes (lossless, usually far smaller than the pixels; large messages travel in parts, as every payload
    of the rank transport), once per group; anything PNG cannot hold (another type, a mode PNG lacks) as it is. An
    image object held by several groups (a tool turn's job has one group a sample: the samples of a prompt share
    its images) is encoded once, and the message pickles its bytes once (pickle keeps one copy of an object)."""
    if groups is None:
        return None
    return _once_each(groups, png_bytes)


def decode_job_images(groups: list[list] | None) -> list[list] | None:
    """:func:`encode_job_images` undone: PNG bytes back to PIL images (pixels, mode and size as written); a payload
    held by several groups (one object after unpickling) is decoded once, into one image they share."""
    if groups is None:
        return None
    return _once_each(groups, from_png)


def _once_each(groups: list[list], code) -> list[list]:
    """``code`` of each image of ``groups``, once per object: an object the groups hold several times gives one
    result, shared."""
    done: dict[int, object] = {}
    for imgs in groups:
        for img in imgs or []:
            if id(img) not in done:
                done[id(img)] = code(img)
    return [[done[id(img)] for img in imgs or []] for imgs in groups]


def job_message(job: int, groups: list[list[int]], n: int, sampling, agent=None, images: list[list] | None = None
                ) -> dict:
    """The ``job`` message the rollout ranks read: each group's prompt once (``groups``), ``n``, the sampling, the
    job's entry (``agent``) and each group's images once, as PNG bytes (:func:`encode_job_images`)."""
    return {"kind": "job", "id": job, "prompts": groups, "n": n, "sampling": sampling,
            **({"agent": agent} if agent is not None else {}),
            **({"images": encode_job_images(images)} if images else {})}


def read_job_images(message: dict, start: int, stop: int) -> tuple[dict, list | None]:
    """A rollout rank's side of a job's images: the ``message`` with each group's images decoded (once a group;
    handlers that keep groups read them there) and, per sample ``start, ..., stop - 1`` of its slice, its group's
    images (the same objects for a group's ``n`` samples); None for a job without images."""
    pics = decode_job_images(message.get("images"))
    if pics is None:
        return message, None
    n = message["n"]
    return {**message, "images": pics}, [pics[i // n] for i in range(start, stop)]


def png_bytes(img):
    """A PIL image as its PNG file's bytes (lossless: pixels, mode and size); anything PNG cannot hold (another type,
    a mode PNG lacks: CMYK, I;16...) as it is. Also a partial pool's checkpoint (trainer/partial.py)."""
    import io

    from PIL import Image

    if not isinstance(img, Image.Image) or img.mode not in PNG_MODES:  # (CMYK, I;16...: the image itself)
        return img
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def from_png(data):
    """:func:`png_bytes` undone: PNG bytes as a PIL image (loaded); anything else as it is."""
    import io

    from PIL import Image

    if not (isinstance(data, bytes) and data.startswith(PNG_SIGNATURE)):
        return data
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None, pin: bool = False) -> tuple[torch.Tensor, list[tuple[str, tuple, str, int]]]:
    """One bucket as a flat CPU byte buffer and its layout ``[(name, shape, dtype, offset)]``. ``dtype``: floating
    tensors are cast to it first (the engine's dtype: what it keeps of them anyway, e.g. bf16 instead of the float32
    that FSDP2 or an fp32 master hands out). ``out``: a buffer to pack into when it is large enough (a view of it is
    returned), else a new one (page-locked with ``pin``: a device-to-host copy and a send run from it faster)."""
    cast = [(name, t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t)
            for name, t in bucket]
    layout, offset = [], 0
    for name, t in cast:
        layout.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
        offset += math.ceil(t.numel() * t.element_size() / _ALIGN) * _ALIGN
    if out is not None and out.numel() >= offset:
        buf = out[:offset]
    else:
        buf = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for (_, t), (_, _, _, at) in zip(cast, layout):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[at:at + flat.numel()].copy_(flat)  # device -> host here
    return buf, layout


def unpack_bucket(buf: torch.Tensor, layout: list[tuple[str, tuple, str, int]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of :func:`pack_bucket`'s buffer (views of it)."""
    out = []
    for name, shape, dtype, at in layout:
        dt = getattr(torch, dtype)
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=dt).element_size()
        out.append((name, buf[at:at + size].view(dt).view(shape)))
    return out


def frame_bucket(buf: torch.Tensor, layout: list, delta: DeltaHeader | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What crosses the weights group for one bucket: a header ``[size of the meta, size of the data]`` (int64)
    and the pickled meta ``(layout, delta)`` (bytes); the data itself follows as ``buf`` (the packed bucket, or its
    encoding against the receivers' copy when ``delta`` says so: :mod:`~trl_nrollout.rollout.ranks.weight_delta`)."""
    meta = torch.frombuffer(bytearray(pickle.dumps((layout, delta), protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    return torch.tensor([meta.numel(), buf.numel()], dtype=torch.int64), meta


def dtype_of(name: str | None) -> torch.dtype | None:
    """The engine's dtype as vLLM names it (``torch.bfloat16`` or ``bfloat16``); None when unknown."""
    if not name:
        return None
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None
