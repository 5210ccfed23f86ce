"""Write the local sites' task sets (``shop.json``, ``forum.json``) in WebArena's config format.

Run ``python -m envs.web.tasks.build_tasks`` after changing the sites' seed data or the templates below; the
JSON files are committed and a test checks they match this script. Each task carries, besides WebArena's
fields, ``split`` ("train" / "test": within each template every 4th instance is held out) and ``expert``:
a hand-written solution as WebArena actions whose element ids are *locators* ``[role 'name']`` that the
scripted expert (``envs.webarena.contract.expert_action``) resolves against the current observation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from envs.web.sites import forum, shop
from envs.web.sites.common import money

HERE = Path(__file__).resolve().parent


def _q(s: str) -> str:
    return "'" + s + "'"


class _Builder:
    def __init__(self, site: str, placeholder: str):
        self.site, self.ph = site, placeholder
        self.tasks: list[dict[str, Any]] = []
        self._count: dict[int, int] = {}

    def add(self, template_id: int, template: str, inst: dict[str, Any], evaluation: dict[str, Any],
            expert: list[str], start: str = "/") -> None:
        n = self._count.get(template_id, 0)
        self._count[template_id] = n + 1
        intent = template.format(**inst)
        ev = {"eval_types": [], "reference_answers": None, "reference_url": "", "program_html": [],
              "string_note": "", "url_note": "GOLD in PRED"}
        ev.update(evaluation)
        self.tasks.append({
            "task_id": len(self.tasks),
            "sites": [self.site],
            "require_login": False,
            "storage_state": None,
            "start_url": f"{self.ph}{start}",
            "geolocation": None,
            "intent_template": template,
            "instantiation_dict": inst,
            "intent": intent,
            "require_reset": False,
            "eval": ev,
            "intent_template_id": template_id,
            "split": "test" if n % 4 == 3 else "train",
            "expert": expert,
        })


def shop_tasks() -> list[dict[str, Any]]:
    b = _Builder("shop", "__SHOP__")
    P = {p[0]: shop.product(p[0]) for p in shop.PRODUCTS}
    search = "type [searchbox 'Search products'] [{}] [1]"

    for pid in (1, 7, 13, 19, 4, 10, 16, 22):
        p = P[pid]
        b.add(0, "What is the price of the {product}?", {"product": p["name"]},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [money(p["price"])[1:]]}},
              [search.format(p["name"]), f"click [link {_q(p['name'])}]", f"stop [{money(p['price'])}]"])
    for pid in (2, 8, 14, 20, 5, 11):
        p = P[pid]
        cat = shop.CATEGORIES[p["category"]]
        b.add(1, "What is the customer rating of the {product}?", {"product": p["name"]},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [str(p["rating"])]}},
              [f"click [link {_q(cat)}]", f"click [link {_q(p['name'])}]", f"stop [{p['rating']}]"])
    for slug, cat in shop.CATEGORIES.items():
        items = sorted((P[x[0]] for x in shop.PRODUCTS if x[2] == slug), key=lambda p: p["price"])
        b.add(2, "Which product in the {category} category is the cheapest?", {"category": cat},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [items[0]["name"]]}},
              [f"click [link {_q(cat)}]", "click [link 'Sort by price']", f"stop [{items[0]['name']}]"])
    for slug, cat in shop.CATEGORIES.items():
        items = sorted((P[x[0]] for x in shop.PRODUCTS if x[2] == slug), key=lambda p: -p["price"])
        b.add(3, "Which product in the {category} category is the most expensive?", {"category": cat},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [items[0]["name"]]}},
              [f"click [link {_q(cat)}]", f"stop [{items[0]['name']}]"])
    for pid, qty in ((1, 2), (9, 1), (15, 3), (21, 1), (3, 1), (12, 4), (17, 2), (24, 1)):
        p = P[pid]
        b.add(4, "Add {quantity} x {product} to my cart.", {"quantity": qty, "product": p["name"]},
              {"eval_types": ["program_html"], "program_html": [{
                  "url": "__SHOP__/cart",
                  "locator": "document.querySelector('#cart') ? document.querySelector('#cart').innerText : ''",
                  "required_contents": {"must_include": [p["name"], money(p["price"] * qty)]}}]},
              [search.format(p["name"]), f"click [link {_q(p['name'])}]", f"type [spinbutton 'Quantity'] [{qty}] [0]",
               "click [button 'Add to cart']", "stop []"])
    people = [("Sam Lee", "4 Oak Road"), ("Ana Silva", "9 Pine Lane"), ("Kim Park", "77 Bay Street"),
              ("Jo Brown", "1 Mill Way"), ("Lu Chen", "30 Hill Court"), ("Max Stone", "5 River Walk")]
    for (pid, (name, addr)) in zip((6, 8, 18, 20, 2, 23), people):
        p = P[pid]
        b.add(5, "Buy one {product} and ship it to {name}, {address}.",
              {"product": p["name"], "name": name, "address": addr},
              {"eval_types": ["program_html"], "program_html": [{
                  "url": "__SHOP__/orders/1004", "locator": "",
                  "required_contents": {"must_include": [p["name"] + " x 1", name, addr]}}]},
              [search.format(p["name"]), f"click [link {_q(p['name'])}]", "click [button 'Add to cart']",
               "click [link 'Checkout']", f"type [textbox 'Full name'] [{name}] [0]",
               f"type [textbox 'Address'] [{addr}] [0]", "click [button 'Place order']", "stop []"])
    for o in shop.SEED_ORDERS:
        b.add(6, "What was the total of my order #{order}?", {"order": o["id"]},
              {"eval_types": ["string_match"],
               "reference_answers": {"must_include": [money(shop.order_total(o))[1:]]}},
              ["click [link 'My orders']", f"stop [{money(shop.order_total(o))}]"])
    for o in shop.SEED_ORDERS:
        b.add(7, "What is the status of my order #{order}?", {"order": o["id"]},
              {"eval_types": ["string_match"], "reference_answers": {"exact_match": o["status"]}},
              ["click [link 'My orders']", f"click [link 'Order #{o['id']}']", f"stop [{o['status']}]"])
    for slug, cat in shop.CATEGORIES.items():
        b.add(8, "Show me the products of the {category} category sorted by price.", {"category": cat},
              {"eval_types": ["url_match"], "reference_url": f"__SHOP__/category/{slug}?sort=price"},
              [f"click [link {_q(cat)}]", "click [link 'Sort by price']", "stop []"])
    for q in ("pens", "lamp", "cable"):
        b.add(9, "Search the shop for \"{query}\".", {"query": q},
              {"eval_types": ["url_match"], "reference_url": f"__SHOP__/search?q={q}"},
              [search.format(q), "stop []"])
    return b.tasks


def forum_tasks() -> list[dict[str, Any]]:
    b = _Builder("forum", "__FORUM__")
    posts = {p[0]: p for p in forum.SEED_POSTS}

    def open_post(pid: int) -> list[str]:
        _, f, title, *_ = posts[pid]
        return [f"click [link {_q(forum.FORUMS[f])}]", f"click [link {_q(title)}]"]

    for pid in (1, 5, 9, 13, 2, 12):
        _, f, title, author, score, body, comments = posts[pid]
        b.add(0, "How many comments does the post \"{title}\" have?", {"title": title},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [str(len(comments))]}},
              open_post(pid) + [f"stop [{len(comments)}]"])
    for pid in (3, 7, 11, 15, 6, 10):
        _, f, title, author, *_ = posts[pid]
        b.add(1, "Who wrote the post \"{title}\"?", {"title": title},
              {"eval_types": ["string_match"], "reference_answers": {"exact_match": author}},
              [f"click [link {_q(forum.FORUMS[f])}]", f"stop [{author}]"])
    for pid in (4, 8, 12, 16, 1, 14):
        _, f, title, author, score, *_ = posts[pid]
        b.add(2, "Upvote the post \"{title}\".", {"title": title},
              {"eval_types": ["program_html"], "program_html": [{
                  "url": f"__FORUM__/post/{pid}", "locator": "document.querySelector('#score').innerText",
                  "required_contents": {"exact_match": f"{score + 1} points"}}]},
              open_post(pid) + [f"click [button {_q('Upvote ' + title)}]", "stop []"])
    for pid in (2, 6, 10, 13):
        _, f, title, author, score, *_ = posts[pid]
        b.add(3, "Downvote the post \"{title}\".", {"title": title},
              {"eval_types": ["program_html"], "program_html": [{
                  "url": f"__FORUM__/post/{pid}", "locator": "document.querySelector('#score').innerText",
                  "required_contents": {"exact_match": f"{score - 1} points"}}]},
              open_post(pid) + [f"click [button {_q('Downvote ' + title)}]", "stop []"])
    replies = ["Thanks for sharing!", "I agree with this.", "Great question.", "Same here.",
               "Good tip, will try it.", "Following this thread."]
    for pid, text in zip((3, 8, 11, 15, 5, 9), replies):
        title = posts[pid][2]
        b.add(4, "Reply to the post \"{title}\" with the comment \"{text}\".", {"title": title, "text": text},
              {"eval_types": ["program_html"], "program_html": [{
                  "url": f"__FORUM__/post/{pid}", "locator": "document.querySelector('#comments').innerText",
                  "required_contents": {"must_include": [f"alex: {text}"]}}]},
              open_post(pid) + [f"type [textbox 'Your comment'] [{text}] [0]", "click [button 'Post comment']",
                                "stop []"])
    new_posts = [("books", "Audiobook recommendations"), ("cooking", "Best rice cooker"),
                 ("gardening", "Growing peppers indoors"), ("travel", "Cheap hostels in Porto")]
    for f, t in new_posts:
        b.add(5, "Create a post titled \"{title}\" in the {forum} forum.", {"title": t, "forum": forum.FORUMS[f]},
              {"eval_types": ["program_html"], "program_html": [
                  {"url": f"__FORUM__/f/{f}", "locator": "", "required_contents": {"must_include": [t]}},
                  {"url": "__FORUM__/u/alex", "locator": "", "required_contents": {"must_include": [t]}}]},
              [f"click [link {_q(forum.FORUMS[f])}]", "click [link 'New post']", f"type [textbox 'Title'] [{t}] [0]",
               "click [button 'Create post']", "stop []"])
    for f, name in forum.FORUMS.items():
        top = sorted((p for p in forum.SEED_POSTS if p[1] == f), key=lambda p: (-p[4], p[0]))[0]
        b.add(6, "What is the title of the top post in the {forum} forum?", {"forum": name},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [top[2]]}},
              [f"click [link {_q(name)}]", f"stop [{top[2]}]"])
    for f, name in forum.FORUMS.items():
        b.add(7, "Open the {forum} forum.", {"forum": name},
              {"eval_types": ["url_match"], "reference_url": f"__FORUM__/f/{f}"},
              [f"click [link {_q(name)}]", "stop []"])
    for pid in (5, 9, 14, 16):
        _, f, title, author, score, *_ = posts[pid]
        b.add(8, "How many points does the post \"{title}\" have?", {"title": title},
              {"eval_types": ["string_match"], "reference_answers": {"must_include": [str(score)]}},
              open_post(pid) + [f"stop [{score}]"])
    return b.tasks


def build() -> dict[str, list[dict[str, Any]]]:
    return {"shop": shop_tasks(), "forum": forum_tasks()}


def main() -> None:
    for name, tasks in build().items():
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(tasks, indent=1) + "\n")
        n_test = sum(t["split"] == "test" for t in tasks)
        print(f"{path}: {len(tasks)} tasks ({len(tasks) - n_test} train, {n_test} test)")


if __name__ == "__main__":
    main()
