"""Small web apps of our own (a shop and a forum) served on loopback with per-episode state.

Every URL of a site lives under ``/e/<episode key>/<site>/``; the state behind a key (cart, orders, votes,
comments, ...) is created from the seed data on first use and dropped when the episode ends, so two
episodes never see each other's clicks. ``envs.web.sites.server.SiteServer`` runs them (and MiniWoB's
HTML files under ``/miniwob/``) in a background thread of the env server's process.
"""
