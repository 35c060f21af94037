"""Weight tensors of a GGUF: where their bytes sit, which ones rpc-server caches, the model shape.

The tensor list is read on the control machine. For a model on a Hugging Face endpoint only the
header travels: header_from_http fetches the header by HTTP Range into a sparse file of the full
size, so gguf's GGUFReader (which maps a whole file) parses it without the weights.
"""

from __future__ import annotations

import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


from meshdeploy.core.gguf import GgufHeaderError, Header, from_reader, header_end, parse_header
from meshdeploy.placement import defaults as d
from meshdeploy.placement.kvcache import swa_layers

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# llama-arch.cpp: tensors of LLM_TENSOR_LAYER_INPUT; llama.cpp keeps the input layer on the CPU
# of the orchestrator, so these never reach a worker (unless tied as the output, see placement).
INPUT_TENSORS = ("token_embd.", "position_embd.", "token_types.", "per_layer_token_embd.")


@dataclass(frozen=True)
class Tensor:
    name: str
    offset: int  # absolute byte offset of the tensor's data in the file
    size: int  # bytes, as rpc-server receives them (ggml_nbytes)
    layer: int | None  # N of blk.N.*, None for input/output tensors

    @property
    def hashed(self) -> bool:
        """rpc-server caches (and the orchestrator hashes) only weights above the threshold."""
        return self.size > d.placement_hash_threshold

    @property
    def is_input(self) -> bool:
        return self.layer is None and self.name.startswith(INPUT_TENSORS)


def read_header(source) -> Header:
    """The header of a GGUF path (reading only its first bytes), or of a GGUFReader."""
    if isinstance(source, Header):
        return source
    if not isinstance(source, (str, os.PathLike)):
        return from_reader(source)  # gguf's GGUFReader (not imported here: see core.gguf)
    path = Path(source)
    try:
        with open(path, "rb") as f:
            # A local read costs little: start where most headers end, so that the header is
            # parsed once (each try parses all it has; a vocabulary of 262k tokens is 6 MB).
            return _read(f, str(path), d.placement_header_local_first)[1]
    except OSError as exc:
        raise GgufHeaderError(f"{path}: {exc.strerror}") from None


def header_bytes(f, name: str) -> bytes:
    """The header of an open binary file (local, or an SFTP file on a host), read only as far
    as the tensor infos go: 1 MiB, then four times more until they are complete."""
    return _read(f, name, d.placement_header_first_fetch)[0]


def _read(f, name: str, first: int) -> tuple[bytes, Header]:
    """(header bytes, parsed header) of an open file, reading `first` bytes, then four times
    more until the tensor infos are complete."""
    buf, want = b"", first
    while True:
        while len(buf) < want:
            chunk = f.read(want - len(buf))
            if not chunk:
                break
            buf += chunk
        header = parse_header(buf)
        if header is not None:
            return buf[:header.data_offset], header
        if len(buf) < want or want >= d.placement_header_max:
            raise GgufHeaderError(f"{name}: no complete GGUF header in its first "
                                  f"{len(buf)} bytes")
        want *= 4


def weight_tensors(gguf_path_or_header) -> list[Tensor]:
    """Every tensor of the GGUF in file order.

    + gguf_path_or_header: a GGUF path (a sparse header file works), a GGUFReader or a Header
    Example: weight_tensors("gemma-3-270m-q4_k_m.gguf")[1] ==
             Tensor("token_embd.weight", 6527680, 178257920, None)   # .hashed is True
    """
    out = []
    for name, offset, size in read_header(gguf_path_or_header).tensors:
        m = _BLOCK.match(name)
        out.append(Tensor(name, offset, size, int(m.group(1)) if m else None))
    return out


def model_shape(reader) -> dict:
    """Sizes that decide where a model fits.

    ```python
    {"arch": "gemma3", "n_layers": 18, "layer_bytes": [bytes of blk.0, ...],
     "input_bytes": 178257920, "output_bytes": 2560, "tied_output": True,
     "output_device_bytes": 178260480,   # what the output device holds (tied: + token_embd)
     "k_elems_layer": [256, ...], "v_elems_layer": [256, ...],   # KV elements per token
     "swa_layers": [True, ...], "n_swa": 512, "n_ctx_train": 32768}
    ```
    kvcache.layer_bytes() turns the KV fields into bytes at a server's settings.
    """
    header = read_header(reader)
    fields = header.fields
    arch = fields.get("general.architecture")
    if not arch:
        raise GgufHeaderError("the GGUF has no general.architecture")
    n_layers = fields.get(f"{arch}.block_count")
    if n_layers is None:
        raise GgufHeaderError(f"the GGUF has no {arch}.block_count")
    n_layers = int(n_layers)
    tensors = weight_tensors(header)
    layer_bytes = [0] * n_layers
    input_bytes = output_bytes = 0
    for t in tensors:
        if t.layer is not None and t.layer < n_layers:
            layer_bytes[t.layer] += t.size
        elif t.is_input:
            input_bytes += t.size
        else:
            output_bytes += t.size
    tied = not any(t.name == "output.weight" for t in tensors)
    embd = next((t.size for t in tensors if t.name == "token_embd.weight"), 0)
    n_embd = int(fields.get(f"{arch}.embedding_length") or 0)
    n_head = _per_layer(fields.get(f"{arch}.attention.head_count"), n_layers)
    n_head_kv = _per_layer(fields.get(f"{arch}.attention.head_count_kv"), n_layers) \
        if fields.get(f"{arch}.attention.head_count_kv") is not None else n_head
    k_len = fields.get(f"{arch}.attention.key_length")
    v_len = fields.get(f"{arch}.attention.value_length")
    # Multi-head latent attention (deepseek2 and kin): the cache holds the compressed K only.
    mla = fields.get(f"{arch}.attention.key_length_mla") is not None
    k_elems, v_elems = [], []
    for il in range(n_layers):
        # llama-hparams: n_embd_head_k defaults to n_embd / n_head when key_length is absent.
        head_k = int(k_len) if k_len is not None else (n_embd // n_head[il] if n_head[il] else 0)
        head_v = int(v_len) if v_len is not None else head_k
        k_elems.append(n_head_kv[il] * head_k)
        v_elems.append(0 if mla else n_head_kv[il] * head_v)
    swa, n_swa = swa_layers(fields, arch, n_layers)
    return {
        "arch": arch, "n_layers": n_layers, "layer_bytes": layer_bytes,
        "input_bytes": input_bytes, "output_bytes": output_bytes, "tied_output": tied,
        "output_device_bytes": output_bytes + (embd if tied else 0),
        "k_elems_layer": k_elems, "v_elems_layer": v_elems, "swa_layers": swa, "n_swa": n_swa,
        "n_ctx_train": int(fields.get(f"{arch}.context_length") or 0),
    }


def _per_layer(value, n_layers: int) -> list[int]:
    """Head counts are a scalar or, in some architectures, one value per layer."""
    if value is None:
        return [0] * n_layers
    if isinstance(value, list):
        values = [int(v) for v in value]
        return (values + [values[-1]] * n_layers)[:n_layers] if values else [0] * n_layers
    return [int(value)] * n_layers


# ---- header over HTTP ----------------------------------------------------------------------------

def _origin(url: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port), or None for a URL whose port is not a number (a redirect's
    Location is the server's to write): such a URL is no origin the token may follow to."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    return parts.scheme, (parts.hostname or "").lower(), \
        port or {"http": 80, "https": 443}.get(parts.scheme)


def token_follows(old: str, new: str) -> bool:
    """Whether the token goes on from `old` to the redirect `new`: only to the same origin
    (scheme, host and port), or from http on port 80 up to https on 443 of the same host, as
    httpx and curl decide. Never from https down to http: same host:port is not enough."""
    was, now = _origin(old), _origin(new)
    if was is None or now is None:
        return False
    return now == was or (was[1] == now[1] and (was[0], was[2]) == ("http", 80)
                          and (now[0], now[2]) == ("https", 443))


class _DropAuthOffOrigin(urllib.request.HTTPRedirectHandler):
    """The Hub redirects LFS files to a CDN with a signed URL: the token stays with the Hub,
    and never follows a redirect to plain http (token_follows)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and not token_follows(req.full_url, new.full_url):
            for key in list(new.headers):
                if key.lower() == "authorization":
                    del new.headers[key]
        return new


def _fetch(opener, url: str, start: int, end: int, headers: dict) -> bytes:
    req = urllib.request.Request(url, headers={**headers, "Range": f"bytes={start}-{end}"})
    try:
        with opener.open(req, timeout=d.placement_http_timeout) as resp:
            if resp.status != 206 and start > 0:
                raise GgufHeaderError(f"{url}: the server ignored the Range request "
                                      f"(HTTP {resp.status}); a header-only read needs Range")
            # A server that ignores Range would send the whole file: read only what was asked.
            return resp.read(end - start + 1)
    except urllib.error.HTTPError as exc:
        code = exc.headers.get("X-Error-Code") if exc.headers else None
        raise GgufHeaderError(f"{url}: HTTP {exc.code}{f' ({code})' if code else ''}") from None
    except urllib.error.URLError as exc:
        raise GgufHeaderError(f"{url}: {exc.reason}") from None
    except (ValueError, OSError) as exc:  # a redirect to a malformed URL, a reset connection
        raise GgufHeaderError(f"{url}: {exc}") from None


def header_from_http(url: str, size: int, token: str | None = None,
                     headers: dict | None = None, dest: Path | None = None) -> Path:
    """A sparse file of `size` bytes holding only the GGUF header fetched from `url`.

    + url: a resolve URL (meshdeploy's hfmirror, huggingface.co, any server honouring Range)
    + size: the file's full size (the Hub's X-Linked-Size / model_info)
    + token: sent as "Authorization: Bearer <token>", never to a redirect's other origin
    + dest: where to write; default a new temporary file. The caller deletes it.
    Example: weight_tensors(header_from_http(url, 253113024))
    """
    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    opener = urllib.request.build_opener(_DropAuthOffOrigin)
    buf = b""
    want = d.placement_header_first_fetch
    while True:
        end = min(want, size) - 1
        if end >= len(buf):
            buf += _fetch(opener, url, len(buf), end, hdrs)
        data_start = header_end(buf)
        if data_start is not None:
            break
        if len(buf) >= size or want >= d.placement_header_max:
            raise GgufHeaderError(f"{url}: no complete GGUF header in the first {len(buf)} bytes"
                                  + (" (the whole given size: is the size right?)"
                                     if len(buf) >= size else ""))
        want *= 4
    if data_start > size:
        raise GgufHeaderError(f"{url}: the header ends at byte {data_start}, past the given "
                              f"size {size}: wrong size for this file?")
    if dest is None:
        fd, name = tempfile.mkstemp(prefix="meshdeploy-gguf-header-", suffix=".gguf")
        os.close(fd)
        dest = Path(name)
    with open(dest, "wb") as f:
        f.write(buf[:data_start])
        f.truncate(size)  # the weights stay a hole: nothing is allocated or downloaded
    return Path(dest)
