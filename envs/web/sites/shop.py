"""The local shop: catalogue, categories, search, product pages, cart, checkout and order history.

All pages are server-rendered HTML; forms POST and redirect (303). Prices are integer cents. The signed-in
customer is "Alex Doe"; three past orders exist in the seed state.
"""

from __future__ import annotations

import copy
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from envs.web.sites.common import e, episode_base, state_route, money, page

CATEGORIES = {
    "kitchen": "Kitchen",
    "office": "Office",
    "outdoor": "Outdoor",
    "electronics": "Electronics",
}

# id, name, category, price (cents), rating, reviews, description
PRODUCTS: list[tuple[int, str, str, int, float, int, str]] = [
    (1, "Blue Ceramic Mug", "kitchen", 1250, 4.5, 18, "A 350 ml stoneware mug, dishwasher safe."),
    (2, "Steel Chef Knife", "kitchen", 4999, 4.8, 52, "A 20 cm forged steel knife."),
    (3, "Bamboo Cutting Board", "kitchen", 2400, 4.1, 9, "A large board made of bamboo."),
    (4, "Glass Teapot", "kitchen", 3175, 3.9, 14, "A 1 litre teapot with a steel infuser."),
    (5, "Cast Iron Pan", "kitchen", 3890, 4.7, 33, "A 26 cm pre-seasoned frying pan."),
    (6, "Silicone Spatula", "kitchen", 699, 4.2, 41, "Heat resistant up to 250 degrees."),
    (7, "Black Gel Pens", "office", 899, 4.4, 60, "A pack of 12 smooth gel pens."),
    (8, "A5 Dotted Notebook", "office", 1499, 4.6, 27, "160 pages of dotted paper."),
    (9, "Desk Lamp", "office", 2999, 4.0, 12, "An LED lamp with three brightness levels."),
    (10, "Stapler", "office", 1150, 3.7, 8, "Staples up to 25 sheets."),
    (11, "Paper Shredder", "office", 6450, 4.3, 21, "Cross-cut shredder for 8 sheets."),
    (12, "Sticky Notes", "office", 450, 4.9, 75, "6 pads of 100 yellow notes."),
    (13, "Camping Tent", "outdoor", 12900, 4.4, 16, "A two-person tent weighing 2.1 kg."),
    (14, "Hiking Backpack", "outdoor", 8950, 4.6, 29, "A 40 litre pack with rain cover."),
    (15, "Water Bottle", "outdoor", 1999, 4.5, 88, "A 750 ml insulated bottle."),
    (16, "Folding Chair", "outdoor", 3400, 3.8, 11, "A light chair that folds flat."),
    (17, "Head Torch", "outdoor", 2275, 4.2, 37, "A 300 lumen rechargeable torch."),
    (18, "Sleeping Bag", "outdoor", 7600, 4.1, 19, "Comfortable down to 2 degrees."),
    (19, "Wireless Mouse", "electronics", 2590, 4.3, 64, "A silent mouse with a USB receiver."),
    (20, "USB-C Cable", "electronics", 999, 4.0, 102, "A 2 m braided charging cable."),
    (21, "Bluetooth Speaker", "electronics", 5499, 4.5, 47, "Waterproof, 12 hours of play."),
    (22, "Mechanical Keyboard", "electronics", 10900, 4.7, 31, "Tenkeyless, brown switches."),
    (23, "Webcam", "electronics", 4725, 3.6, 22, "1080p camera with a microphone."),
    (24, "Power Bank", "electronics", 3150, 4.2, 58, "10000 mAh, two USB ports."),
]

SEED_ORDERS = [
    {"id": 1001, "date": "2024-03-02", "status": "Delivered", "name": "Alex Doe", "address": "12 Elm Street",
     "items": [[7, 2], [12, 1]]},
    {"id": 1002, "date": "2024-05-17", "status": "Delivered", "name": "Alex Doe", "address": "12 Elm Street",
     "items": [[15, 1]]},
    {"id": 1003, "date": "2024-06-09", "status": "Shipped", "name": "Alex Doe", "address": "12 Elm Street",
     "items": [[19, 1], [20, 3]]},
]


def product(pid: int) -> dict[str, Any] | None:
    for p in PRODUCTS:
        if p[0] == pid:
            return {"id": p[0], "name": p[1], "category": p[2], "price": p[3], "rating": p[4], "reviews": p[5],
                    "description": p[6]}
    return None


def order_total(order: dict[str, Any]) -> int:
    return sum(product(pid)["price"] * qty for pid, qty in order["items"])  # type: ignore[index]


def fresh_state() -> dict[str, Any]:
    return {"cart": {}, "orders": copy.deepcopy(SEED_ORDERS), "next_order": 1004}


# --- pages ---------------------------------------------------------------------------------------------------
def _base(request: Request) -> str:
    return episode_base(request, "shop")


def _nav(request: Request, state: dict[str, Any]) -> str:
    b = _base(request)
    n = sum(state["cart"].values())
    return (
        f"<a href='{b}/'>Home</a><a href='{b}/cart'>Cart ({n})</a><a href='{b}/orders'>My orders</a>"
        f"<form action='{b}/search' method='get' style='display:inline'>"
        "<input type='search' name='q' aria-label='Search products'> <button type='submit'>Search</button></form>"
    )


def _product_list(b: str, items: list[dict[str, Any]]) -> str:
    if not items:
        return "<p>No products found.</p>"
    rows = "".join(f"<li><a href='{b}/product/{p['id']}'>{e(p['name'])}</a> {money(p['price'])}</li>" for p in items)
    return f"<ul>{rows}</ul>"


def _html(request: Request, state: dict[str, Any], title: str, body: str) -> HTMLResponse:
    return HTMLResponse(page(f"{title} - One Stop Shop", _nav(request, state), body))


# --- pages (one function per route) ---------------------------------------------------------------------
async def _home(request: Request, st: dict[str, Any]) -> Response:
    b = _base(request)
    cats = "".join(f"<li><a href='{b}/category/{k}'>{e(v)}</a></li>" for k, v in CATEGORIES.items())
    return _html(request, st, "Home", f"<h1>One Stop Shop</h1><h2>Categories</h2><ul>{cats}</ul>")


async def _category(request: Request, st: dict[str, Any]) -> Response:
    slug = request.path_params["slug"]
    if slug not in CATEGORIES:
        return _html(request, st, "Not found", "<h1>Category not found</h1>")
    items = [product(p[0]) for p in PRODUCTS if p[2] == slug]
    sort = request.query_params.get("sort", "")
    if sort == "price":
        items.sort(key=lambda p: p["price"])
    b = _base(request)
    body = (f"<h1>{e(CATEGORIES[slug])}</h1><p>{len(items)} products. "
            f"<a href='{b}/category/{slug}?sort=price'>Sort by price</a></p>" + _product_list(b, items))
    return _html(request, st, CATEGORIES[slug], body)


async def _search(request: Request, st: dict[str, Any]) -> Response:
    q = request.query_params.get("q", "").strip()
    words = q.lower().split()
    items = [product(p[0]) for p in PRODUCTS if words and all(w in p[1].lower() for w in words)]
    body = f"<h1>Search results for '{e(q)}'</h1>" + _product_list(_base(request), items)
    return _html(request, st, "Search", body)


async def _product_page(request: Request, st: dict[str, Any]) -> Response:
    p = product(int(request.path_params["pid"]))
    if p is None:
        return _html(request, st, "Not found", "<h1>Product not found</h1>")
    b = _base(request)
    body = (
        f"<h1>{e(p['name'])}</h1><p>Price: {money(p['price'])}</p>"
        f"<p>Rating: {p['rating']} out of 5 ({p['reviews']} reviews)</p><p>{e(p['description'])}</p>"
        f"<form action='{b}/cart/add' method='post'><input type='hidden' name='pid' value='{p['id']}'>"
        "<label for='qty'>Quantity</label> <input id='qty' type='number' name='qty' value='1' min='1'> "
        "<button type='submit'>Add to cart</button></form>"
        f"<p>Category: <a href='{b}/category/{p['category']}'>{e(CATEGORIES[p['category']])}</a></p>"
    )
    return _html(request, st, p["name"], body)


async def _cart_add(request: Request, st: dict[str, Any]) -> Response:
    form = await request.form()
    try:
        pid, qty = int(form.get("pid", "0")), max(1, int(form.get("qty", "1") or 1))
    except ValueError:
        pid, qty = 0, 1
    if product(pid) is not None:
        st["cart"][pid] = st["cart"].get(pid, 0) + qty
    return RedirectResponse(f"{_base(request)}/cart", status_code=303)


async def _cart_remove(request: Request, st: dict[str, Any]) -> Response:
    form = await request.form()
    try:
        st["cart"].pop(int(form.get("pid", "0")), None)
    except ValueError:
        pass
    return RedirectResponse(f"{_base(request)}/cart", status_code=303)


async def _cart(request: Request, st: dict[str, Any]) -> Response:
    b = _base(request)
    if not st["cart"]:
        return _html(request, st, "Cart", "<h1>Your cart</h1><p id='cart-empty'>Your cart is empty.</p>")
    rows, total = [], 0
    for pid, qty in st["cart"].items():
        p = product(pid)
        total += p["price"] * qty
        rows.append(
            f"<tr><td>{e(p['name'])}</td><td>{qty}</td><td>{money(p['price'] * qty)}</td><td>"
            f"<form action='{b}/cart/remove' method='post'><input type='hidden' name='pid' value='{pid}'>"
            f"<button type='submit' aria-label='Remove {e(p['name'])}'>Remove</button></form></td></tr>"
        )
    body = (
        "<h1>Your cart</h1><table id='cart'><tr><th>Product</th><th>Quantity</th><th>Subtotal</th><th></th></tr>"
        + "".join(rows) + f"</table><p>Total: {money(total)}</p><a href='{b}/checkout'>Checkout</a>"
    )
    return _html(request, st, "Cart", body)


async def _checkout(request: Request, st: dict[str, Any]) -> Response:
    b = _base(request)
    if request.method == "POST":
        form = await request.form()
        name, address = str(form.get("name", "")).strip(), str(form.get("address", "")).strip()
        if not st["cart"]:
            return _html(request, st, "Checkout", "<h1>Checkout</h1><p>Your cart is empty.</p>")
        if not name or not address:
            err = "<p role='alert'>Please fill in your full name and address.</p>"
            return _html(request, st, "Checkout", "<h1>Checkout</h1>" + err + _checkout_form(b))
        oid = st["next_order"]
        st["next_order"] += 1
        st["orders"].append({"id": oid, "date": "2024-07-01", "status": "Processing", "name": name,
                             "address": address, "items": [[pid, q] for pid, q in st["cart"].items()]})
        st["cart"] = {}
        return RedirectResponse(f"{b}/orders/{oid}", status_code=303)
    if not st["cart"]:
        return _html(request, st, "Checkout", "<h1>Checkout</h1><p>Your cart is empty.</p>")
    return _html(request, st, "Checkout", "<h1>Checkout</h1>" + _checkout_form(b))


async def _orders(request: Request, st: dict[str, Any]) -> Response:
    b = _base(request)
    rows = "".join(
        f"<tr><td><a href='{b}/orders/{o['id']}'>Order #{o['id']}</a></td><td>{o['date']}</td>"
        f"<td>{money(order_total(o))}</td><td>{o['status']}</td></tr>"
        for o in sorted(st["orders"], key=lambda o: -o["id"])
    )
    body = ("<h1>My orders</h1><table id='orders'><tr><th>Order</th><th>Date</th><th>Total</th><th>Status</th>"
            f"</tr>{rows}</table>")
    return _html(request, st, "My orders", body)


async def _order(request: Request, st: dict[str, Any]) -> Response:
    oid = int(request.path_params["oid"])
    o = next((o for o in st["orders"] if o["id"] == oid), None)
    if o is None:
        return _html(request, st, "Not found", "<h1>Order not found</h1>")
    items = "".join(f"<li>{e(product(pid)['name'])} x {q}</li>" for pid, q in o["items"])
    body = (
        f"<h1>Order #{o['id']}</h1><p>Status: {o['status']}</p><p>Date: {o['date']}</p>"
        f"<p>Ship to: {e(o['name'])}, {e(o['address'])}</p><ul id='order-items'>{items}</ul>"
        f"<p>Total: {money(order_total(o))}</p>"
    )
    return _html(request, st, f"Order #{o['id']}", body)


def make_routes(get_state) -> list[Route]:
    """Routes of the shop; ``get_state(request)`` returns the episode's state dict (404 for a key the env did not
    issue). Each page is a module-level ``async (request, state) -> Response`` function."""
    return [
        state_route("/", _home, get_state),
        state_route("/category/{slug}", _category, get_state),
        state_route("/search", _search, get_state),
        state_route("/product/{pid:int}", _product_page, get_state),
        state_route("/cart", _cart, get_state),
        state_route("/cart/add", _cart_add, get_state, methods=["POST"]),
        state_route("/cart/remove", _cart_remove, get_state, methods=["POST"]),
        state_route("/checkout", _checkout, get_state, methods=["GET", "POST"]),
        state_route("/orders", _orders, get_state),
        state_route("/orders/{oid:int}", _order, get_state),
    ]


def _checkout_form(b: str) -> str:
    return (
        f"<form action='{b}/checkout' method='post'>"
        "<p><label for='name'>Full name</label> <input id='name' name='name'></p>"
        "<p><label for='address'>Address</label> <input id='address' name='address'></p>"
        "<button type='submit'>Place order</button></form>"
    )
