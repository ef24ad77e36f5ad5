"""The data plane: worker processes that serve the router's port and relay bytes.

`worker` (one process: the listening socket, the owner link, non-inference endpoints
passed through to the owner) and `relay` (one inference request: parse, ask the owner,
forward, stream the answer back, report the attempt). A worker keeps no policy state.

May import: `router.protocol`, `router.engines`, `router.wire`, `router.config`. Never
`router.owner`: the owner decides and the plane asks it over `router.protocol.link`.
"""
