"""The local forum: forums, posts with scores, comments, up/down votes and new posts.

The signed-in user is "alex". A user votes at most once per post (voting again in the same direction
takes the vote back, the other direction switches it).
"""

from __future__ import annotations

import copy
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from envs.web.sites.common import e, episode_base, state_route, page

USER = "alex"
FORUMS = {
    "books": "Books",
    "cooking": "Cooking",
    "gardening": "Gardening",
    "travel": "Travel",
}

# id, forum, title, author, score, body, [(author, comment), ...]
SEED_POSTS: list[tuple[int, str, str, str, int, str, list[tuple[str, str]]]] = [
    (1, "books", "Best science fiction of the decade", "mira", 42, "Which novels stayed with you?",
     [("tom", "The long quiet ones."), ("ana", "Anything with generation ships."), ("li", "Short stories count?")]),
    (2, "books", "Reading slump advice", "tom", 17, "I have not finished a book in months.",
     [("mira", "Try audiobooks on walks.")]),
    (3, "books", "Libraries with late opening hours", "ana", 8, "Looking for a quiet place after work.", []),
    (4, "books", "Poetry for beginners", "li", 23, "Where should I start?",
     [("tom", "Start with short modern poems."), ("mira", "Read them aloud.")]),
    (5, "cooking", "Sourdough starter died again", "kai", 31, "Third time this year.",
     [("ana", "Feed it twice a day."), ("mira", "Keep it warmer."), ("tom", "Use rye flour."),
      ("li", "Mine lives in the fridge.")]),
    (6, "cooking", "Quick weeknight dinners", "mira", 54, "Share your 20 minute recipes.",
     [("kai", "Fried rice with leftovers.")]),
    (7, "cooking", "Cast iron care myths", "tom", 12, "Can I use soap or not?",
     [("kai", "A little soap is fine."), ("ana", "Dry it on the stove.")]),
    (8, "cooking", "Favourite spice blends", "li", 5, "Mine is smoked paprika with cumin.", []),
    (9, "gardening", "Tomatoes splitting", "ana", 19, "The fruit cracks after rain.",
     [("kai", "Water more evenly.")]),
    (10, "gardening", "Balcony herb garden", "kai", 36, "Basil, mint and chives on a small balcony.",
     [("mira", "Mint needs its own pot."), ("li", "Chives come back every year.")]),
    (11, "gardening", "Composting in winter", "li", 9, "Does the pile stop working?", []),
    (12, "gardening", "Slugs eating lettuce", "tom", 27, "Every night another plant is gone.",
     [("ana", "Go out with a torch."), ("kai", "Copper tape helps."), ("mira", "Ducks!")]),
    (13, "travel", "Night trains in Europe", "mira", 61, "Which routes are worth it?",
     [("tom", "Vienna to Venice."), ("kai", "Book a cabin early.")]),
    (14, "travel", "Packing light for two weeks", "ana", 38, "One backpack only.",
     [("li", "Merino shirts.")]),
    (15, "travel", "Hiking near Lisbon", "kai", 14, "Day trips without a car?", []),
    (16, "travel", "Travel insurance questions", "li", 3, "Is a yearly plan worth it?",
     [("mira", "If you travel three times a year, yes.")]),
]


def fresh_state() -> dict[str, Any]:
    posts = {}
    next_comment = 1
    for pid, forum, title, author, score, body, comments in SEED_POSTS:
        cs = []
        for a, t in comments:
            cs.append({"id": next_comment, "author": a, "text": t})
            next_comment += 1
        posts[pid] = {"id": pid, "forum": forum, "title": title, "author": author, "score": score, "body": body,
                      "comments": cs, "vote": 0}
    return {"posts": copy.deepcopy(posts), "next_post": 17, "next_comment": next_comment}


def _base(request: Request) -> str:
    return episode_base(request, "forum")


def _nav(request: Request) -> str:
    b = _base(request)
    forums = "".join(f"<a href='{b}/f/{k}'>{e(v)}</a>" for k, v in FORUMS.items())
    return f"<a href='{b}/'>Front page</a>{forums}<a href='{b}/u/{USER}'>My posts</a>"


def _html(request: Request, title: str, body: str) -> HTMLResponse:
    return HTMLResponse(page(f"{title} - Forum", _nav(request), body))


def _vote_buttons(b: str, post: dict[str, Any]) -> str:
    t = e(post["title"])
    return (
        f"<form action='{b}/post/{post['id']}/vote' method='post' style='display:inline'>"
        f"<button name='dir' value='up' aria-label='Upvote {t}'>Upvote</button>"
        f"<button name='dir' value='down' aria-label='Downvote {t}'>Downvote</button></form>"
    )


def _post_list(b: str, posts: list[dict[str, Any]]) -> str:
    if not posts:
        return "<p>No posts yet.</p>"
    rows = "".join(
        f"<li><a href='{b}/post/{p['id']}'>{e(p['title'])}</a> by {e(p['author'])}, {p['score']} points, "
        f"{len(p['comments'])} comments</li>"
        for p in posts
    )
    return f"<ol>{rows}</ol>"


# --- pages (one function per route) ---------------------------------------------------------------------
async def _front(request: Request, st: dict[str, Any]) -> Response:
    top = sorted(st["posts"].values(), key=lambda p: (-p["score"], p["id"]))[:5]
    return _html(request, "Front page", "<h1>Front page</h1><h2>Top posts</h2>" + _post_list(_base(request), top))


async def _forum(request: Request, st: dict[str, Any]) -> Response:
    name = request.path_params["name"]
    if name not in FORUMS:
        return _html(request, "Not found", "<h1>Forum not found</h1>")
    b = _base(request)
    posts = sorted((p for p in st["posts"].values() if p["forum"] == name), key=lambda p: (-p["score"], p["id"]))
    body = (f"<h1>{e(FORUMS[name])}</h1><p><a href='{b}/f/{name}/submit'>New post</a></p>"
            + _post_list(b, posts))
    return _html(request, FORUMS[name], body)


async def _submit(request: Request, st: dict[str, Any]) -> Response:
    name = request.path_params["name"]
    if name not in FORUMS:
        return _html(request, "Not found", "<h1>Forum not found</h1>")
    b = _base(request)
    err = ""
    if request.method == "POST":
        form = await request.form()
        title, body = str(form.get("title", "")).strip(), str(form.get("body", "")).strip()
        if title:
            pid = st["next_post"]
            st["next_post"] += 1
            st["posts"][pid] = {"id": pid, "forum": name, "title": title, "author": USER, "score": 1,
                                "body": body, "comments": [], "vote": 1}
            return RedirectResponse(f"{b}/post/{pid}", status_code=303)
        err = "<p role='alert'>A post needs a title.</p>"
    form = (
        f"<form action='{b}/f/{name}/submit' method='post'>"
        "<p><label for='title'>Title</label> <input id='title' name='title'></p>"
        "<p><label for='body'>Body</label> <textarea id='body' name='body'></textarea></p>"
        "<button type='submit'>Create post</button></form>"
    )
    return _html(request, "New post", f"<h1>New post in {e(FORUMS[name])}</h1>{err}{form}")


async def _post(request: Request, st: dict[str, Any]) -> Response:
    p = st["posts"].get(int(request.path_params["pid"]))
    if p is None:
        return _html(request, "Not found", "<h1>Post not found</h1>")
    b = _base(request)
    comments = "".join(f"<li>{e(c['author'])}: {e(c['text'])}</li>" for c in p["comments"]) or "<li>No comments yet.</li>"
    body = (
        f"<h1>{e(p['title'])}</h1><p>Posted by <a href='{b}/u/{p['author']}'>{e(p['author'])}</a> in "
        f"<a href='{b}/f/{p['forum']}'>{e(FORUMS[p['forum']])}</a></p>"
        f"<p id='score'>{p['score']} points</p>{_vote_buttons(b, p)}<p>{e(p['body'])}</p>"
        f"<h2>{len(p['comments'])} comments</h2><ul id='comments'>{comments}</ul>"
        f"<form action='{b}/post/{p['id']}/comment' method='post'>"
        "<label for='comment'>Your comment</label> <textarea id='comment' name='text'></textarea> "
        "<button type='submit'>Post comment</button></form>"
    )
    return _html(request, p["title"], body)


async def _vote(request: Request, st: dict[str, Any]) -> Response:
    p = st["posts"].get(int(request.path_params["pid"]))
    b = _base(request)
    if p is None:
        return RedirectResponse(f"{b}/", status_code=303)
    form = await request.form()
    d = {"up": 1, "down": -1}.get(str(form.get("dir", "")), 0)
    if d:
        new = 0 if p["vote"] == d else d
        p["score"] += new - p["vote"]
        p["vote"] = new
    return RedirectResponse(f"{b}/post/{p['id']}", status_code=303)


async def _comment(request: Request, st: dict[str, Any]) -> Response:
    p = st["posts"].get(int(request.path_params["pid"]))
    b = _base(request)
    if p is None:
        return RedirectResponse(f"{b}/", status_code=303)
    form = await request.form()
    text = str(form.get("text", "")).strip()
    if text:
        p["comments"].append({"id": st["next_comment"], "author": USER, "text": text})
        st["next_comment"] += 1
    return RedirectResponse(f"{b}/post/{p['id']}", status_code=303)


async def _user(request: Request, st: dict[str, Any]) -> Response:
    name = request.path_params["name"]
    posts = sorted((p for p in st["posts"].values() if p["author"] == name), key=lambda p: p["id"])
    return _html(request, name, f"<h1>Posts by {e(name)}</h1>" + _post_list(_base(request), posts))


def make_routes(get_state) -> list[Route]:
    """Routes of the forum; ``get_state(request)`` returns the episode's state dict (404 for a key the env did not
    issue). Each page is a module-level ``async (request, state) -> Response`` function."""
    return [
        state_route("/", _front, get_state),
        state_route("/f/{name}", _forum, get_state),
        state_route("/f/{name}/submit", _submit, get_state, methods=["GET", "POST"]),
        state_route("/post/{pid:int}", _post, get_state),
        state_route("/post/{pid:int}/vote", _vote, get_state, methods=["POST"]),
        state_route("/post/{pid:int}/comment", _comment, get_state, methods=["POST"]),
        state_route("/u/{name}", _user, get_state),
    ]
