"""Guard options are checked by name when a task is declared (Celery and RQ): a misspelt guard
option is a ConfigError with "did you mean", never silently ignored (Celery keeps unknown task
options as attributes) nor a bare TypeError (RQ); each adapter says which guard options it does
not take and where that feature lives for its framework; Celery's own options and a user's own
attributes that look like guard options keep working."""

from __future__ import annotations

import keyword
import string

import pytest
from celery import Celery, Task

from taskguard import ConfigError, MemoryLocks
from taskguard.policy import OPTION_NAMES
from taskguard_celery import GuardedTask, guarded_task
from taskguard_rq import guarded_job
from taskguard_rq.job import RQ_OPTIONS


def body():
    return 1


def body_self(self):
    return 1


def job(n=1):
    return n


def _app():
    app = Celery("decl", set_as_current=False)
    app.conf.taskguard_locks = MemoryLocks()
    return app


@pytest.mark.parametrize("declare", ["app.task", "guarded_task"])
@pytest.mark.parametrize(
    "option, meant",
    [
        ("ttll", "ttl"),
        ("waits", "wait"),
        ("once_tl", "once_ttl"),
        ("renewal", "renew"),
        ("limits", "limit"),
        # the short ones the similarity ratio missed: case and two letters swapped (kye="report:{n}"
        # left every call on the one lease named after the task)
        ("kye", "key"),
        ("Key", "key"),
        ("KEY", "key"),
        ("TTL", "ttl"),
        ("wiat", "wait"),
        ("tll", "ttl"),
        ("kez", "key"),
        ("TLL", "ttl"),
        # two slips in a long name; another form of the option's word
        ("skip_rety_dlay", "skip_retry_delay"),
        ("enforced", "enforce"),
        ("waiting", "wait"),
    ],
)
def test_a_misspelt_guard_option_is_refused_on_celery(declare, option, meant):
    app = _app()
    with pytest.raises(ConfigError, match=rf"task 'decl\.t': unknown option '{option}'; did you mean '{meant}'\?"):
        if declare == "app.task":  # Celery makes the task class when the app is finalized
            app.task(base=GuardedTask, name="decl.t", shared=False, **{option: 5})(body)
            app.finalize()
        else:
            guarded_task(name="decl.t", **{option: 5})(body)


def _one_slip_of(option: str) -> set[str]:
    """Every name one slip from ``option``: a letter (or ``_``) changed, added or dropped, two
    adjacent letters swapped, or all upper case — keeping the first letter of an option of four
    letters or fewer (``host`` is a word, not a slip of ``cost``); valid keyword names only, none
    a guard option."""
    letters = string.ascii_lowercase + "_"
    out = {option.upper()}
    for i in range(len(option) + 1):
        out.update(option[:i] + c + option[i:] for c in letters)
    for i in range(len(option)):
        out.add(option[:i] + option[i + 1 :])
        out.update(option[:i] + c + option[i + 1 :] for c in letters)
    out.update(option[:i] + option[i + 1] + option[i] + option[i + 2 :] for i in range(len(option) - 1))
    if len(option) <= 4:
        out = {v for v in out if v[:1].lower() == option[0]}
    return {v for v in out if v.isidentifier() and not keyword.iskeyword(v) and v.lower() not in OPTION_NAMES}


@pytest.mark.parametrize("adapter", ["celery", "rq"])
def test_every_one_slip_misspelling_of_every_guard_option_is_refused_with_did_you_mean(adapter):
    """The kind behind ``ttll`` and ``kye``: every name one slip from a guard option the adapter
    takes (about 16,000 names; on Celery, those that are no attribute of the task's classes) is a
    ConfigError with "did you mean". ``tll`` and ``kez`` were accepted on Celery (the similarity
    ratio rates a changed letter in a 3-letter name 0.67) and ran with the default TTL and key."""
    options = OPTION_NAMES if adapter == "celery" else RQ_OPTIONS
    not_taken = set().union(*(_one_slip_of(o) for o in OPTION_NAMES if o not in options))
    missed = []
    for option in options:
        for name in sorted(_one_slip_of(option)):
            if adapter == "celery" and hasattr(GuardedTask, name):
                continue  # Celery's own (or the task's): kept, as the test below shows
            if name in not_taken:
                continue  # also a slip of an option this adapter does not take: refused, listing them
            try:
                if adapter == "celery":
                    guarded_task(name="decl.t", **{name: 5})(body)
                else:
                    guarded_job(name="decl.j", **{name: 5})(body)
            except ConfigError as e:
                if "did you mean" not in str(e):
                    missed.append((name, str(e)))
            else:
                missed.append((name, "accepted"))
    assert missed == [], missed[:20]


def test_celery_options_and_user_attributes_close_to_guard_options_keep_working():
    """``max_retries`` is close to ``skip_max_retries`` and ``rate_limit`` to ``rate``... but they
    are Celery's own; a base class's own attribute close to a guard option is the user's."""

    class Base(Task):
        waits = 3  # the user's own, close to 'wait'
        limits = "mine"

    app = _app()
    t = app.task(
        base=GuardedTask,
        name="decl.ok",
        shared=False,
        ttl=5,
        max_retries=7,
        rate_limit="10/m",
        default_retry_delay=2,
        time_limit=30,
        soft_time_limit=20,
        acks_late=True,
        bind=True,
    )(body_self)
    app.finalize()
    assert (t.ttl, t.max_retries, t.rate_limit, t.time_limit) == (5, 7, "10/m", 30)
    guarded_task(name="decl.base", base=Base, ttl=4, max_retries=2)(body)  # accepted
    guarded_task(name="decl.attrs", region="eu", kind="mine")(body)  # not slips of a guard option: kept
    v = app.task(base=type("Mixed", (GuardedTask, Base), {}), name="decl.mixed", shared=False, waits=4, limits="x")(
        body
    )
    app.finalize()
    assert (v.waits, v.limits) == (4, "x")


#: Names of users' own task attributes that only look like guard options (``difflib`` rates
#: ``title`` against ``ttl`` 0.75): Celery keeps them as task attributes.
OWN_ATTRIBUTES = (
    "title total host post done none force before date create new unique_id private_key "
    "blocking_timeout read_timeout on_close lease_ttl lock_key region kind"
).split()


def test_users_own_attributes_that_only_look_like_guard_options_keep_working_on_celery():
    """Passed to ``app.task`` / ``guarded_task`` or defined on a class-based task (a method
    included), these are the user's: refused, a task could not have them at all. (``title``,
    ``host``, ``done``, ``create``... were refused as misspellings of ``ttl``, ``cost``, ``once``,
    ``rate``.)"""
    app = _app()
    for name in OWN_ATTRIBUTES:
        t = app.task(base=GuardedTask, name=f"decl.own.{name}", shared=False, **{name: 1})(body)
        guarded_task(name=f"decl.own.g.{name}", **{name: 1})(body)
    app.finalize()
    assert t.kind == 1

    class Export(GuardedTask):
        name = "decl.export"
        ttl = 30
        host = "sftp.example.com"

        def create(self, row):
            return row

        def run(self, n):
            return n

    assert Export.taskguard_options.ttl == 30 and Export.host == "sftp.example.com"


def test_a_misspelt_guard_option_on_a_base_class_of_tasks_is_refused_when_the_class_is_made():
    """``class Reports(GuardedTask): tll = 300`` — every task of it took the misspelling as
    known (a class in its MRO defines it) and ran with the default TTL and key."""
    with pytest.raises(ConfigError, match=r"task base class '.*Reports': unknown option 'tll'; did you mean 'ttl'\?"):

        class Reports(GuardedTask):
            tll = 300

    with pytest.raises(ConfigError, match=r"unknown option 'Key'; did you mean 'key'\?"):
        type("Keyed", (GuardedTask,), {"Key": "report"})

    class Fine(GuardedTask):  # a base class of guard options and its own attributes
        ttl = 300
        host = "sftp"

    assert guarded_task(name="decl.fine", base=Fine)(body).taskguard_options.ttl == 300


@pytest.mark.parametrize(
    "option, meant", [("ttll", "ttl"), ("waits", "wait"), ("on_skipp", "on_skip"), ("kye", "key"), ("TTL", "ttl")]
)
def test_a_misspelt_guard_option_is_refused_on_rq(option, meant):
    with pytest.raises(ConfigError, match=rf"job 'decl\.j': unknown option '{option}'; did you mean '{meant}'\?"):
        guarded_job(name="decl.j", **{option: 5})(body)


def test_rq_errors_name_the_job_as_a_job_and_celery_errors_the_task_as_a_task():
    """Every declaration error (an option's value, a per-call callable's value, the durability
    check) says what the framework calls it."""
    with pytest.raises(ConfigError, match=r"^job 'decl\.j': ttl must be"):
        guarded_job(name="decl.j", ttl=-1)(body)
    with pytest.raises(ConfigError, match=r"^task 'decl\.t': ttl must be"):
        guarded_task(name="decl.t", ttl=-1)(body)
    rq_job = guarded_job(name="decl.cost", key="c:{n}", rate="5/s", cost=lambda n: -1)(job)
    with pytest.raises(ConfigError, match=r"^job 'decl\.cost': .*cost"):
        rq_job.taskguard_options.cost_of((1,), {})


def test_an_unknown_option_on_rq_is_a_config_error_listing_the_guard_options():
    with pytest.raises(ConfigError, match=r"unknown option 'queue_name' \(guard options: .*\bttl\b"):
        guarded_job(name="decl.j", queue_name="q")(body)


@pytest.mark.parametrize(
    "option, where",
    [
        ("unique", "enqueue_unique"),
        ("unique_ttl", "enqueue_unique"),
        ("continue_on_skip", "depends_on"),
        ("skip_retry_delay", "on_skip='retry', which RQ jobs do not have"),
        ("skip_max_retries", "on_skip='retry', which RQ jobs do not have"),
    ],
)
def test_rq_refuses_the_guard_options_it_does_not_take_and_says_where_they_live(option, where):
    with pytest.raises(ConfigError, match=rf"job 'decl\.j': option '{option}' is not supported here: .*{where}"):
        guarded_job(name="decl.j", key="uq:{n}", **{option: True if option in ("unique", "continue_on_skip") else 5})(
            job
        )


def test_each_adapter_declares_what_it_takes():
    assert set(RQ_OPTIONS) == set(OPTION_NAMES) - {
        "unique",
        "unique_ttl",
        "continue_on_skip",
        "skip_retry_delay",
        "skip_max_retries",
    }
    for name in RQ_OPTIONS:  # every declared option is really taken (valid defaults)
        guarded_job(name="decl.all", **{name: _valid(name)})(job)


def _valid(name):
    from taskguard.policy import OPTION_DEFAULTS

    return {"key": "k:{n}", "once": False, "fingerprint": None}.get(name, OPTION_DEFAULTS[name])


def test_wrong_arguments_are_a_type_error_even_without_a_redis_configured(monkeypatch):
    """The arguments are bound before the lease store is looked up: with no Redis configured
    (no ``taskguard_locks``, no URL, no ``TASKGUARD_REDIS_URL``) a caller's wrong arguments are
    still Python's ``TypeError``, not the missing-configuration ``ConfigError``."""
    monkeypatch.delenv("TASKGUARD_REDIS_URL", raising=False)
    app = Celery("noredis", set_as_current=False)
    task = app.task(base=GuardedTask, name="decl.noredis", shared=False, key="w:{n}")(job)
    app.finalize()
    with pytest.raises(TypeError, match="too many positional arguments"):
        task(1, 2)
    with pytest.raises(ConfigError, match="TASKGUARD_REDIS_URL"):
        task(1)  # right arguments: now the missing store is the error
    rq_job = guarded_job(name="decl.noredis.rq", key="w:{n}")(job)
    with pytest.raises(TypeError, match="too many positional arguments"):
        rq_job(1, 2)


def test_an_empty_celery_prefix_setting_is_refused_not_replaced_by_the_default(redis_url):
    app = Celery("emptyprefix", set_as_current=False)
    app.conf.taskguard_redis_url = redis_url
    app.conf.taskguard_prefix = ""
    task = app.task(base=GuardedTask, name="decl.emptyprefix", shared=False, key="w:{n}")(job)
    app.finalize()
    with pytest.raises(ConfigError, match="app.conf.taskguard_prefix must be 1-64 characters"):
        task(1)


@pytest.mark.parametrize(
    "var, meant",
    [
        ("TASKGUARD_PREFX", "TASKGUARD_PREFIX"),
        ("TASKGUARD_REDIS_URI", "TASKGUARD_REDIS_URL"),
        ("TASKGUARD_METRIC", "TASKGUARD_METRICS"),
    ],
)
def test_a_misspelt_environment_variable_is_refused(redis_url, var, meant):
    from taskguard import from_env

    with pytest.raises(ConfigError, match=f"the environment: {var} is not a taskguard setting; did you mean {meant}"):
        from_env({"TASKGUARD_REDIS_URL": redis_url, var: "x"})
    # another tool's variable far from every taskguard one passes
    assert from_env({"TASKGUARD_REDIS_URL": redis_url, "TASKGUARD_SOMETHING_ELSE_ENTIRELY": "1"}).prefix == "taskguard"


def test_a_misspelt_celery_setting_is_refused(redis_url):
    app = Celery("typo", set_as_current=False)
    app.conf.taskguard_redis_url = redis_url
    app.conf.taskguard_prefx = "mine"
    task = app.task(base=GuardedTask, name="decl.typo", shared=False, key="w:{n}")(job)
    app.finalize()
    with pytest.raises(
        ConfigError, match="app.conf: taskguard_prefx is not a taskguard setting; did you mean taskguard_prefix"
    ):
        task(1)


def test_a_misspelt_celery_setting_under_a_namespace_is_refused(redis_url):
    """Django's ``app.config_from_object("django.conf:settings", namespace="CELERY")``: a misspelt
    ``CELERY_TASKGUARD_PREFX`` was not looked at (only keys starting ``taskguard_`` were), so the
    default prefix applied in silence; the correctly spelt one is read."""
    app = Celery("typo-ns", set_as_current=False)
    app.config_from_object(
        {"CELERY_TASKGUARD_REDIS_URL": redis_url, "CELERY_TASKGUARD_PREFX": "mine"}, namespace="CELERY"
    )
    task = app.task(base=GuardedTask, name="decl.typo_ns", shared=False, key="w:{n}")(job)
    app.finalize()
    with pytest.raises(ConfigError, match="taskguard_prefx is not a taskguard setting; did you mean taskguard_prefix"):
        task(1)
    for key, form in (
        ("TASKGUARD_PREFIX", "CELERY_TASKGUARD_PREFIX"),  # outside the namespace: never read
        ("celery_taskguard_prefix", "CELERY_TASKGUARD_PREFIX"),
        ("CELERY_taskguard_prefx", "CELERY_TASKGUARD_PREFIX"),
    ):
        unread = Celery("unread-ns", set_as_current=False)
        unread.config_from_object({"CELERY_TASKGUARD_REDIS_URL": redis_url, key: "mine"}, namespace="CELERY")
        t = unread.task(base=GuardedTask, name="decl.unread_ns", shared=False, key="w:{n}")(job)
        with pytest.raises(ConfigError, match=f"app.conf: {key} is never read by taskguard .*; write {form}"):
            t(1)
    plain = Celery("unread-plain", set_as_current=False)  # no namespace: lower case only
    plain.config_from_object({"taskguard_redis_url": redis_url, "TASKGUARD_PREFIX": "mine"})
    t = plain.task(base=GuardedTask, name="decl.unread_plain", shared=False, key="w:{n}")(job)
    with pytest.raises(ConfigError, match="TASKGUARD_PREFIX is never read by taskguard .*; write taskguard_prefix"):
        t(1)
    good = Celery("good-ns", set_as_current=False)
    good.config_from_object(
        {"CELERY_TASKGUARD_REDIS_URL": redis_url, "CELERY_TASKGUARD_PREFIX": "mine"}, namespace="CELERY"
    )
    assert good.task(base=GuardedTask, name="decl.good_ns", shared=False)(job).taskguard_locks.prefix == "mine"


def test_a_subclass_of_a_task_class_takes_its_own_guard_options():
    """``class BigExport(Export)`` with its own ``ttl`` / ``key`` and ``Export``'s body: the guard kept
    ``Export``'s options (its key and TTL), and ``ttl = -5`` on such a subclass was accepted."""

    class Export(GuardedTask):
        name = "decl.export"
        ttl = 60
        key = "export:{tenant}"

        def run(self, tenant):
            return tenant

    class BigExport(Export):
        name = "decl.big_export"
        ttl = 600
        key = "big-export:{tenant}"

    class SameExport(Export):  # nothing of its own: the same guard as its base's
        name = "decl.same_export"

    big, same = BigExport.taskguard_options, SameExport.taskguard_options
    assert Export.taskguard_options.ttl == 60 and big.ttl == 600 and same.ttl == 60
    assert big.key.render(("acme",), {}) == "big-export:acme" and same.key.render(("acme",), {}) == "export:acme"
    with pytest.raises(ConfigError, match="ttl must be"):

        class Broken(Export):
            ttl = -5

    with pytest.raises(ConfigError, match="unknown option 'kye'; did you mean 'key'"):

        class Misspelt(Export):
            kye = "x:{tenant}"

    class Base(GuardedTask):  # no body anywhere: a base class of tasks, no guard of its own
        ttl = 30

    assert Base.taskguard_options is None


def test_task_annotations_set_guard_options_and_a_misspelt_one_is_refused():
    """``app.conf.task_annotations`` (Celery sets them as task attributes when the task is bound):
    guard options there were ignored (the guard was built from the class before), a misspelt one
    too. They apply now, checked like the decorator's; Celery's own options there keep working."""
    app = Celery("annotated", set_as_current=False)
    app.conf.task_annotations = {"decl.annotated": {"ttl": 300, "key": "annotated:{n}", "max_retries": 9}}
    task = app.task(base=GuardedTask, name="decl.annotated", shared=False, ttl=5)(job)
    app.finalize()
    assert task.taskguard_options.ttl == 300 and task.taskguard_options.key.render((1,), {}) == "annotated:1"
    assert task.max_retries == 9
    bad = Celery("annotated-bad", set_as_current=False)
    bad.conf.task_annotations = {"decl.annotated": {"ttll": 5}}
    bad.task(base=GuardedTask, name="decl.annotated", shared=False)(job)
    with pytest.raises(ConfigError, match="unknown option 'ttll'; did you mean 'ttl'"):
        bad.finalize()
    worse = Celery("annotated-worse", set_as_current=False)
    worse.conf.task_annotations = {"decl.annotated": {"ttl": 0}}
    worse.task(base=GuardedTask, name="decl.annotated", shared=False)(job)
    with pytest.raises(ConfigError, match="ttl must be"):
        worse.finalize()


def prompt_job(prompt, model="small"):
    return prompt


@pytest.mark.parametrize("adapter", ["celery", "rq"])
@pytest.mark.parametrize(
    "opts, match",
    [
        ({"cost": 5}, "cost needs rate="),
        ({"rate": "100/m", "cost": 0}, "cost must be an int from 1"),
        ({"rate": "100/m", "cost": 2.5}, "cost must be an int from 1"),
        ({"rate": "100/m", "cost": 50, "rate_burst": 10}, "cost 50 exceeds rate_burst 10: such a run could never pass"),
        ({"rate": "100/m", "cost": lambda nope: 1}, "does not take|nope"),
    ],
)
def test_bad_cost_options_fail_at_declaration(adapter, opts, match):
    with pytest.raises(ConfigError, match=match):
        if adapter == "celery":
            guarded_task(name="decl.cost", **opts)(prompt_job)
        else:
            guarded_job(**opts)(prompt_job)


def test_a_cost_is_an_int_or_a_callable_of_the_call_and_sets_the_default_burst():
    from taskguard.policy import GuardOptions

    fixed = GuardOptions.build(prompt_job, name="t", rate="90000/m", cost=300)
    assert fixed.cost_of(("hi",), {}) == 300 and fixed.rate_burst is None  # the throttle's default: the cost
    weighted = GuardOptions.build(prompt_job, name="t", rate="90000/m", cost=lambda prompt, **_: len(prompt) * 10)
    assert weighted.rate_burst == 90000  # a callable: one period's worth of cost units
    assert weighted.cost_of(("hello",), {}) == 50 and weighted.cost_of((), {"prompt": "ab", "model": "m"}) == 20
    bad = GuardOptions.build(prompt_job, name="t", rate="90000/m", cost=lambda prompt, **_: "many")
    with pytest.raises(ConfigError, match="cost callable's value"):
        bad.cost_of(("x",), {})
    assert "cost" in OPTION_NAMES and "cost" in RQ_OPTIONS


def export_job(tenant, rows=1):
    return rows


def test_a_limit_is_an_int_or_a_callable_of_the_call_checked_per_run():
    from taskguard.policy import GuardOptions

    per_tenant = GuardOptions.build(
        export_job, name="t", key="export:{tenant}", limit=lambda tenant, **_: 10 if tenant == "premium" else 2
    )
    assert per_tenant.limit_of(("premium",), {}) == 10 and per_tenant.limit_of((), {"tenant": "free"}) == 2
    for bad in (0, 101, "3", None):
        out_of_range = GuardOptions.build(
            export_job, name="t", key="export:{tenant}", limit=lambda tenant, v=bad, **_: v
        )
        with pytest.raises(ConfigError, match=r"the limit callable's value .* must be an int from 1 to 100"):
            out_of_range.limit_of(("x",), {})
    with pytest.raises(ConfigError, match="limit callable .* which it does not take"):
        GuardOptions.build(export_job, name="t", key="export:{tenant}", limit=lambda customer: 2)


@pytest.mark.parametrize("framework", ["celery", "rq"])
@pytest.mark.parametrize("option, value", [("once_ttl", 5), ("once_max_bytes", 1000)])
def test_an_option_that_tunes_once_without_once_is_refused(framework, option, value):
    """``once_ttl=5`` without ``once=True`` was accepted and did nothing (as ``fingerprint=`` is
    refused without it)."""
    declare = guarded_task if framework == "celery" else guarded_job
    with pytest.raises(ConfigError, match=rf"decl\.o.*{option}= needs once=True"):
        declare(name="decl.o", **{option: value})(body)
    declare(name="decl.o2", key="k", once=True, **{option: value})(body)  # with once: fine


def test_unique_ttl_without_unique_is_kept_for_per_call_uniqueness_on_celery():
    """``apply_async(..., unique=True)`` marks with the task's ``unique_ttl``: a task declares it
    without ``unique=True`` for that."""
    assert guarded_task(name="decl.u", key="k", unique_ttl=5)(body).taskguard_options.unique_ttl == 5
