"""Sluice's web tools for agents: fetch, source_read, read, request and sitemap, through the proxy, as text."""
