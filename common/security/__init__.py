"""Transport security and caller authentication shared by both services:
TLS credentials from PEM files (re-read on change), bearer tokens, the
authentication interceptor, and the flags that configure them."""
