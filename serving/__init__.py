"""vLLM serving for AttnRes (installed as `attnres.serving`)."""
