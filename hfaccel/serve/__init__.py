"""``hfaccel serve``: an OpenAI-compatible HTTP server over the engine (needs ``pip install 'hfaccel[serve]'``)."""
