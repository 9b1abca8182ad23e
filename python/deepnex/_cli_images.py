"""deepnex-central's image catalog on the command line:

    deepnex images                                what you may run: NAME TAG SIZE OWNER
                                                  VISIBILITY CREATED
    deepnex image share NAME[:TAG] --with U[,U] | --public
    deepnex image unshare NAME[:TAG] [--with U[,U]]   (without --with: every share)
    deepnex image rm NAME[:TAG]
    deepnex image register NAME[:TAG] SOURCE [--owner U] [--force]   (admins)
    deepnex commit CONTAINER NAME[:TAG]           your running oci container's changes as
                                                  your own (private) image

NAME is your own image or a preset; another user's image that is shared with
you is OWNER/NAME. Address and token as every command against deepnex-central.
"""

import time

from deepnex._cli_common import add_central_args, client, format_table, guard

HEADER = ("NAME", "TAG", "SIZE", "OWNER", "VISIBILITY", "CREATED")


def rows(images):
    """The table's rows (header first) of CentralClient.images() dicts."""
    from deepnex import format_byte_size
    table = [HEADER]
    for i in images:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i["created"]))
        table.append((i["name"], i["tag"], format_byte_size(i["size"]), i["owner"] or "-",
                      i["visibility"], created))
    return table


def _users(text):
    users = [u for u in (text or "").split(",") if u]
    if text is not None and not users:
        raise SystemExit(f"deepnex: --with {text!r}: expected USER[,USER]")
    return users


def _describe(i):
    shared = f" with {','.join(i['shared_with'])}" if i["shared_with"] else ""
    return f"{i['name']}:{i['tag']} {i['visibility']}{shared}"


def _images(args):
    print(format_table(rows(client(args).images())))
    return 0


def _share(args):
    if not args.public and args.users is None:
        raise SystemExit("deepnex: image share: give --with USER[,USER] or --public")
    print(_describe(client(args).share_image(args.name, _users(args.users), public=args.public)))
    return 0


def _unshare(args):
    print(_describe(client(args).unshare_image(args.name, _users(args.users))))
    return 0


def _rm(args):
    i = client(args).remove_image(args.name)
    print(f"removed {i['name']}:{i['tag']}")
    return 0


def _register(args):
    i = client(args).register_image(args.name, args.source, owner=args.owner, force=args.force)
    print(_describe(i))
    return 0


def _commit(args):
    i = client(args).commit(args.container, args.name)
    from deepnex import format_byte_size
    print(f"{_describe(i)} {format_byte_size(i['size'])}")
    return 0


def add_commands(commands):
    p = commands.add_parser("images", help="the images you may run on deepnex-central")
    add_central_args(p)
    p.set_defaults(func=guard(_images))

    p = commands.add_parser("commit", help="save your container's changes as your own image")
    add_central_args(p)
    p.add_argument("container", help="your running container (oci backend)")
    p.add_argument("name", help="NAME[:TAG] of the new image (a new tag of one you have)")
    p.set_defaults(func=guard(_commit))

    image = commands.add_parser("image", help="share, unshare or remove an image")
    sub = image.add_subparsers(dest="image_command", metavar="COMMAND", required=True)
    p = sub.add_parser("share", help="let users (or everyone) run your image")
    add_central_args(p)
    p.add_argument("name", help="NAME[:TAG], your own")
    p.add_argument("--with", dest="users", metavar="USER[,USER]")
    p.add_argument("--public", action="store_true", help="every user may run it")
    p.set_defaults(func=guard(_share))

    p = sub.add_parser("unshare", help="take shares back (without --with: all of them)")
    add_central_args(p)
    p.add_argument("name", help="NAME[:TAG], your own")
    p.add_argument("--with", dest="users", metavar="USER[,USER]")
    p.set_defaults(func=guard(_unshare))

    p = sub.add_parser("rm", help="remove your image (a preset: admins)")
    add_central_args(p)
    p.add_argument("name", help="NAME[:TAG]")
    p.set_defaults(func=guard(_rm))

    p = sub.add_parser("register", help="admins: add an image from a directory on central's host")
    add_central_args(p)
    p.add_argument("name", help="NAME[:TAG]")
    p.add_argument("source", help='an absolute directory on deepnex-central\'s host, or "host"')
    p.add_argument("--owner", help="the user who owns it (default: a preset)")
    p.add_argument("--force", action="store_true", help="replace an image of the same tag")
    p.set_defaults(func=guard(_register))
