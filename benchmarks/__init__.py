"""The lab: the scripts that write the result documents under ``benchmarks/results/<device>/``.

Each script is a module with a thin ``main(argv)``, run from the repository root as
``python -m benchmarks.NAME ...`` (``python -m benchmarks.cost --help``). What several scripts share lives in
:mod:`benchmarks._lib`; the scripts import the product (``bloggap_plugin``) and ``benchmarks._lib``, and one
another only by module name (``from benchmarks.cost import ...``). Not installed with the package.
"""
