"""What requests and answers say, read the same way by the data plane and the owner.

`intake` (a client's bytes -> the request the router forwards), `identity` (which program a
request belongs to), `agent_identity` (which agent role, and its anchor), `sanitize`
(headers read as text, headers forwarded), `auth` (client and admin keys), `accounting`
(usage, cache hits and tool calls read off an answer), and `link` (the messages between a
data-plane worker and the policy owner: `Ticket` out, `Outcome` back).

May import: `router.wire`, `router.policy` (labels, tool keys, types); settings only for
typing. Never `plane`, `owner` or `engines`: both processes stand on this package.
"""
