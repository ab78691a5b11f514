"""Vision towers as pure tensor functions: image patches in, rows of the text model's embedding width out."""
