"""Bytes -> an RGB Pillow image, or one WasteError saying what is wrong with them."""
from __future__ import annotations

import io
import warnings

from ..errors import WasteError

MAX_PIXELS = 50_000_000      # far above what any processor keeps (GLM-5.3: 8000 tokens ~ 25 MP); refused above


def open_image(data: bytes, what: str = "the image", composite: bool = True):
    """Decode fully (a truncated file fails here, not later); alpha is composited onto white, as transformers'
    convert_to_rgb does before every release's processor. composite=False: the image in its own mode (Kimi K3's
    processor fills transparency itself)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)     # our own limit is below it
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise WasteError(f"{what} is {w}x{h} ({w * h / 1e6:.0f} megapixels); the limit is "
                                 f"{MAX_PIXELS / 1e6:.0f} megapixels: send a smaller image")
            img.load()
    except WasteError:
        raise
    except UnidentifiedImageError:
        raise WasteError(f"{what} is not an image Pillow can read ({len(data)} bytes; PNG, JPEG, WebP, GIF, BMP...)") \
            from None
    except Image.DecompressionBombError:
        raise WasteError(f"{what} is over {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels; the limit is "
                         f"{MAX_PIXELS / 1e6:.0f} megapixels: send a smaller image") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise WasteError(f"{what} cannot be decoded: {e} (a truncated or damaged file?)") from None
    if w < 1 or h < 1:
        raise WasteError(f"{what} has no pixels ({w}x{h})")
    if not composite:
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img).convert("RGB")
    return img.convert("RGB")
