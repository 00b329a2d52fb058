"""kvviz app entry point (also the Hugging Face Space's): `python app.py` or `kvviz serve`.

Host and port come from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (default 127.0.0.1:7860).
"""

from kvviz.ui.app import launch

if __name__ == "__main__":
    launch()
