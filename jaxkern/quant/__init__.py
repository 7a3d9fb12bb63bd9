"""FP8 / FP4 / E5M6 casts with per-token, per-block and per-channel scales; ops land here as they are ported."""
