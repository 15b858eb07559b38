"""Disaggregated prefill and decode: the KV connector (connector.py) and the link that carries KV between instances
(link.py)."""
