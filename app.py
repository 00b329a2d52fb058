"""kvviz app entry point (also the Hugging Face Space's): `python app.py` or `kvviz serve`.

Host and port come from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (default 127.0.0.1:7860); models, device,
dtype and limits from the KVVIZ_* variables (kvviz/ui/config.py, README).
"""

from kvviz.ui.app import launch

if __name__ == "__main__":
    try:
        launch()
    except ValueError as error:  # a bad KVVIZ_* setting: say which and what to change, not a traceback
        raise SystemExit(f"kvviz: error: {error}") from None
