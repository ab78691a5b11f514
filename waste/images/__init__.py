"""Images for the vision towers: where an image part's bytes come from (a data: URL, an http(s) URL fetched within
limits, raw bytes or a file the CLI read), decoding with Pillow (refusing what is not an image, truncated, or too
large), and each release's image processor reproduced pixel for pixel (glm5.py)."""
