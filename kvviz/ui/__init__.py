"""The Gradio app: figures built from the engine's step events, and the Blocks layout."""
