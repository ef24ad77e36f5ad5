"""The HTTP/1.1 wire: bytes in and out, shared by every process of the router.

`server` (the data plane's lean HTTP/1.1 server: asyncio protocols and httptools),
`upstream` (the router's one HTTP client, to the engines), `codec` (hot-path JSON) and
`errors` (error bodies in the client's API shape, and the exception carrying one).

May import: nothing else of `router` (the bottom of the shell; the policy core does not
need it either).
"""
